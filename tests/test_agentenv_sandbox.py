"""AgentENV sandboxes tested like an adversary would: one suite parametrised over every backend; a backend
that cannot run here is skipped with "backend unavailable: reason". Isolation, resources (each attack fails
inside while a host heartbeat keeps ticking and nothing is left behind), lifecycle (pause, snapshot, fork)."""
import hashlib
import io
import os
import signal
import socket
import subprocess
import tarfile
import threading
import time

import pytest

from k3.agentenv import Limits, SandboxError, SandboxSpec, get_backend
from k3.agentenv import hostfs

BACKENDS = ["bwrap", "gvisor", "firecracker"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    b = get_backend(request.param)
    ok, reason = b.available()
    if not ok:
        pytest.skip(f"backend unavailable: {request.param}: {reason}")
    return b


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("tpl")
    (d / "src").mkdir()
    (d / "src" / "app.py").write_text("def add(a, b):\n    return a - b\n")
    (d / "README").write_text("template\n")
    (d / ".git").mkdir()  # a repository whose history holds the answer must not reach the sandbox
    (d / ".git" / "FUTURE_COMMIT").write_text("fix: return a + b\n")
    return d


@pytest.fixture(scope="module")
def sb(backend, template):
    s = backend.create(SandboxSpec(template=template, env={"ANSWER_HINT": "visible"}))
    yield s
    s.close()


def need(backend, *names):
    if backend.name not in names:
        pytest.skip(f"{backend.name}: not implemented for this backend")


class Heartbeat:
    """A host thread ticking every 10 ms; `max_gap` is the longest stall it saw."""

    def __enter__(self):
        self.stop, self.ticks, self.max_gap = False, 0, 0.0
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        last = time.monotonic()
        while not self.stop:
            time.sleep(0.01)
            now = time.monotonic()
            self.max_gap, last = max(self.max_gap, now - last), now
            self.ticks += 1

    def __exit__(self, *exc):
        self.stop = True
        self.t.join(2)


# ---- isolation ------------------------------------------------------------------------------------------
def test_template_visible_without_git_history(sb):
    assert sb.read_file("src/app.py").startswith(b"def add")
    names = {e["name"] for e in sb.list_dir("/workspace")}
    assert names == {"src", "README"}, names
    assert sb.exec("ls -a /workspace; find /workspace /tmp /etc /.k3agent -name FUTURE_COMMIT 2>/dev/null").text.count("FUTURE_COMMIT") == 0


def test_writes_outside_workspace_fail(sb, tmp_path):
    host_target = tmp_path / "host_file"
    host_target.write_text("host")
    for cmd in ["echo x > /usr/evil", "echo x > /etc/passwd", "echo x > /workspace/../evil",
                "echo x > /workspace/../../etc/evil", "mkdir /newdir", f"echo x > {host_target}"]:
        r = sb.exec(cmd)
        assert r.exit_code != 0, cmd
    # a symlink planted inside pointing out of the workspace: following it still lands in the sandbox's view
    assert sb.exec(f"ln -s /etc /workspace/etclink && ln -s {tmp_path} /workspace/hostlink").exit_code == 0
    with pytest.raises(SandboxError):
        sb.write_file("etclink/passwd", b"root::0:0::/:/bin/sh\n")
    with pytest.raises(SandboxError):
        sb.write_file("hostlink/host_file", b"pwned")
    assert host_target.read_text() == "host"
    sb.exec("rm -f /workspace/etclink /workspace/hostlink")


def test_host_secret_and_env_invisible(sb, tmp_path):
    secret = tmp_path / "secret.txt"
    token = "SECRET-" + os.urandom(8).hex()
    secret.write_text(token)
    os.environ["K3_TEST_HOST_TOKEN"] = token
    try:
        r = sb.exec(f"cat {secret} 2>&1; env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; ls /root 2>&1")
        assert token not in r.text
        assert "K3_TEST_HOST_TOKEN" not in r.text
        assert "ANSWER_HINT=visible" in r.text  # the spec's env does reach it
        grep = sb.exec(f"grep -rs {token} /etc /tmp /workspace /.k3agent 2>/dev/null | head -1", timeout=20)
        assert token not in grep.text
    finally:
        del os.environ["K3_TEST_HOST_TOKEN"]


def test_proc_shows_only_the_sandbox(sb):
    r = sb.exec("for p in /proc/[0-9]*; do cat $p/cmdline | tr '\\0' ' '; echo; done")
    lines = [ln for ln in r.text.splitlines() if ln.strip()]
    assert 0 < len(lines) < 10, lines
    assert str(os.getpid()) not in sb.exec("ls /proc").text.split()
    assert not any("pytest" in ln for ln in lines)


def test_privileged_operations_fail(sb):
    checks = {
        "mount": "mount -t tmpfs none /tmp 2>&1",
        "userns": "unshare -U true 2>&1",
        "setuid": "python3 -c 'import os; os.setuid(0)' 2>&1",
        "raw socket": "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)' 2>&1",
        "su": "su -c id root </dev/null 2>&1",
    }
    for what, cmd in checks.items():
        r = sb.exec(cmd, timeout=10)
        assert r.exit_code != 0, (what, r.text)
    caps = sb.exec("grep -E 'CapEff|NoNewPrivs' /proc/self/status").text
    assert "CapEff:\t0000000000000000" in caps


def test_dev_has_no_kvm_or_block_devices(sb):
    script = ("import os, stat\nfor n in os.listdir('/dev'):\n  st = os.lstat('/dev/' + n)\n"
              "  print(n, 'block' if stat.S_ISBLK(st.st_mode) else 'other')\n")
    r = sb.exec(["python3", "-c", script])
    assert r.exit_code == 0, r.stderr
    entries = dict(ln.split() for ln in r.text.splitlines())
    assert "kvm" not in entries and "block" not in entries.values(), entries


def test_network_only_loopback_and_host_loopback_unreachable(sb):
    ifaces = sb.exec("cat /proc/net/dev").text.splitlines()[2:]
    assert [ln.split(":")[0].strip() for ln in ifaces] == ["lo"]
    routes = sb.exec("cat /proc/net/route").text.splitlines()[1:]
    assert routes == [], routes  # no route at all: nothing off this machine is reachable (not tried)
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    port = host.getsockname()[1]
    try:
        probe = ("import socket\ns = socket.socket(); s.settimeout(2)\n"
                 f"print(s.connect_ex(('127.0.0.1', {port})))")
        r = sb.exec(["python3", "-c", probe])
        assert r.exit_code == 0 and int(r.text.strip()) != 0, r.text  # refused inside: a different loopback
        host.settimeout(0.2)
        with pytest.raises(socket.timeout):
            host.accept()
    finally:
        host.close()
    inner = ("import socket, threading\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
             "threading.Thread(target=lambda: s.accept()[0].sendall(b'pong'), daemon=True).start()\n"
             "c = socket.create_connection(s.getsockname(), timeout=2); print(c.recv(4).decode())")
    assert sb.exec(["python3", "-c", inner]).text.strip() == "pong"


# ---- resources ------------------------------------------------------------------------------------------
SMALL = Limits(cpu_seconds=2, memory_bytes=96 << 20, pids=32, disk_bytes=16 << 20, output_bytes=64 << 10,
               open_files=64, cpus=0.5, exec_timeout=5)

ATTACKS = {
    "fork bomb": ("bomb() { bomb | bomb & }; bomb; sleep 1", 6),
    "memory bomb": ("python3 -c 'x = [bytearray(1 << 20) for _ in range(1000)]'", 10),
    "disk fill": ("dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>&1; exit 1", 10),
    "tmp fill": ("head -c 200000000 /dev/zero > /tmp/fill; exit 1", 10),
    "huge output": ("yes 0123456789", 10),
    "cpu spin": ("python3 -c 'while True: pass'", 1.5),
    "fd exhaustion": ("python3 -c 'fs = [open(\"/dev/null\") for _ in range(100000)]'", 10),
}


@pytest.fixture(scope="module")
def small(backend):
    # gvisor enforces these inside its own kernel (the guest agent's per-command RLIMIT_NPROC/AS/CPU/FSIZE/
    # NOFILE) with the whole runsc sandbox in a host cgroup as a backstop: see backends/gvisor.py.
    s = backend.create(SandboxSpec(limits=SMALL))
    yield s
    s.close()


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_resource_attacks_fail_inside(small, attack):
    cmd, timeout = ATTACKS[attack]
    with Heartbeat() as hb:
        t0 = time.monotonic()
        r = small.exec(cmd, timeout=timeout)
        took = time.monotonic() - t0
    if attack == "fork bomb":  # the bomb's forks fail; the script's own `sleep` may still succeed
        assert b"Cannot fork" in r.stderr or not r.ok, r
    else:
        assert not r.ok, (attack, r)
    assert took < timeout + 5
    assert hb.max_gap < 1.0, f"host stalled {hb.max_gap:.2f}s during {attack}"
    if attack == "huge output":
        assert r.truncated and len(r.stdout) <= SMALL.output_bytes
    if attack == "cpu spin":
        assert r.timed_out
    # the sandbox is still usable and holds nothing of the attack (one exec: each costs ~0.5 s on gvisor)
    after = small.exec("rm -f /workspace/fill /tmp/fill && echo alive && ps -e -o pid= | wc -l").text.split()
    assert after[0] == "alive" and after[1] in {"3", "4", "5"}, after


def test_gvisor_memory_over_many_processes_ends_whole_sandbox(backend):
    """Each process stays under the per-command RLIMIT_AS, together they pass the sandbox's memory: the host
    cgroup holding the runsc sandbox is the backstop, and its OOM kill ends the whole sandbox (the chosen
    semantics), which then reports itself gone; close leaves nothing behind."""
    need(backend, "gvisor")
    s = backend.create(SandboxSpec(limits=Limits(memory_bytes=64 << 20, pids=32)))
    hog = "python3 -c 'x = bytes(range(256)) * (30 << 12); import time; time.sleep(5)'"  # 30 MiB resident
    with Heartbeat() as hb:
        try:
            r = s.exec(f"for i in $(seq 12); do {hog} & done; wait", timeout=15)
            assert not r.ok, r
        except SandboxError as e:
            assert "sandbox is gone" in str(e)
        assert not s.alive()
        with pytest.raises(SandboxError):
            s.exec("echo alive")
    assert hb.max_gap < 1.0
    s.close()
    assert not s.alive() and not s.dir.exists() and not any(d.exists() for d in s.cg.dirs)


def test_sleep_past_ttl_is_killed_and_nothing_left(backend):
    need(backend, "bwrap", "gvisor")
    s = backend.create(SandboxSpec(ttl=1.0, on_expiry="kill"))
    with Heartbeat() as hb:
        t0 = time.monotonic()
        try:
            r = s.exec("sleep 30", timeout=20)
            assert not r.ok
        except SandboxError:
            pass
        assert time.monotonic() - t0 < 5
    assert hb.max_gap < 1.0
    for _ in range(100):  # the TTL timer's close may still be unmounting
        if s.state == "closed":
            break
        time.sleep(0.05)
    assert s.state == "closed"
    assert not hostfs.mounts_under(s.dir) and not s.dir.exists()
    assert not any(d.exists() for d in s.cg.dirs)  # the sandbox's host cgroup (and so every process) is gone
    # (its directory, checked above, is all it made there: other test processes fill the state directory meanwhile)


def test_close_is_idempotent_and_sweep_reclaims_dead_owner(backend, tmp_path):
    need(backend, "bwrap", "gvisor")
    s = backend.create(SandboxSpec())
    s.exec("setsid sleep 60 >/dev/null 2>&1 < /dev/null &")
    s.close()
    s.close()
    assert not s.dir.exists() and not any(d.exists() for d in s.cg.dirs)
    # a sandbox whose owner died (fake the record: a pid that cannot be alive), on a template only it uses
    (tmp_path / "only-here.txt").write_text(f"{tmp_path}\n")
    s2 = backend.create(SandboxSpec(template=tmp_path))
    template_layer = next(p for p in s2.layers if os.path.basename(p).startswith("tpl-"))
    rec = (s2.dir / "owner.json").read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999')
    (s2.dir / "owner.json").write_text(rec)
    assert backend.sweep() >= 1
    assert not s2.dir.exists() and not any(d.exists() for d in s2.cg.dirs)
    assert not hostfs.mounts_under(s2.dir)
    assert not os.path.exists(template_layer)  # its hold went with it, and so did the layer
    s2.state = "closed"


def run_as(uid: int) -> subprocess.Popen:
    """`sleep 60` started from the host as `uid`, once it runs as that uid."""
    from k3.agentenv import idmap
    p = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"])
    deadline = time.monotonic() + 10
    while p.pid not in idmap.processes_of([uid]):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.01)
    return p


def test_a_process_of_the_sandbox_uid_outside_its_cgroup_ends_with_it(backend):
    """The sandbox's uids are its own: a process running as one that its cgroup does not hold (started from
    the host, as an escape would look) is killed by close(); and a uid some process still runs as is never
    leased to a new sandbox."""
    need(backend, "bwrap")
    from k3.agentenv import idmap
    s = backend.create(SandboxSpec())
    stray = run_as(s.cmd_uid)
    try:
        assert not any(f"-{s.id}" in line for line in open(f"/proc/{stray.pid}/cgroup"))
        s.close()
        assert stray.wait(timeout=5) == -signal.SIGKILL
        assert not (backend.root / "uids" / str(s.cmd_uid)).exists() and idmap.processes_of([s.cmd_uid]) == []
    finally:
        stray.kill()
        stray.wait()
        s.close()
    free = [u for u in range(idmap.UID_BASE, idmap.UID_BASE + 64) if not (backend.root / "uids" / str(u)).exists()]
    lingering = run_as(free[0])  # e.g. a released sandbox's process still exiting
    try:
        picks = iter([free[0] - idmap.UID_BASE, free[1] - idmap.UID_BASE])
        with pytest.MonkeyPatch.context() as mp:  # the lease draws the busy uid first
            mp.setattr(idmap.random, "randrange", lambda n: next(picks))
            got = idmap.lease_uid(backend.root, "probe")
        assert got == free[1]
        idmap.release_uids(backend.root, [got])
    finally:
        lingering.kill()
        lingering.wait()


# ---- lifecycle ------------------------------------------------------------------------------------------
def counter(s):
    return int(s.exec("cat /tmp/count 2>/dev/null || echo 0").text.strip() or 0)


# written to a temporary name and renamed: a reader never sees the file truncated but not yet rewritten
LOOP = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done"


def start_counter(backend):
    """A sandbox with a counting loop running: gvisor runs it as the container's init (processes started
    by `runsc exec` end with their exec session), bwrap as a background exec."""
    if backend.name == "gvisor":
        return backend.create(SandboxSpec(metadata={"init": LOOP}))
    s = backend.create(SandboxSpec())
    s.spawn(LOOP)  # a background exec: a shell `&` child can be reaped with its exec session before it detaches
    return s


def wait_counting(s, timeout: float = 20.0) -> None:
    """Until the loop has written its file (a loaded machine can take seconds to start it)."""
    deadline = time.monotonic() + timeout
    while counter(s) == 0:
        assert time.monotonic() < deadline, "the counting loop never started"
        time.sleep(0.05)


def test_leftovers_names_a_layer_directory_nothing_holds(tmp_path):
    """The suite's no-leftovers check sees a layer whose holds are gone but whose directory stayed (e.g. a
    failed delete), besides the holds themselves."""
    root = tmp_path / "state"
    (root / "layers").mkdir(parents=True)
    stray = root / "layers" / "snap-stray"
    stray.mkdir()
    held = hostfs.new_layer_dir(root, "img-held", "someone")
    found = hostfs.leftovers(root)
    assert f"layer directory {stray} that nothing holds" in found
    assert "layer img-held held by someone" in found and not any("img-held that" in f for f in found)
    hostfs.release_layers(root, [held], "someone")
    assert not held.exists()
    assert not any("img-held" in f for f in hostfs.leftovers(root))


def test_pause_stops_progress_and_resume_continues(backend):
    need(backend, "bwrap", "gvisor")
    s = start_counter(backend)
    try:
        wait_counting(s)
        s.pause()
        with pytest.raises(SandboxError):
            s.exec("true")
        if backend.name == "bwrap":
            frozen = (hostfs.state_root() / "sb" / s.id / "disk" / "scratch" / "count").read_text()
            time.sleep(0.4)
            assert (hostfs.state_root() / "sb" / s.id / "disk" / "scratch" / "count").read_text() == frozen
        s.resume()
        a = counter(s)
        time.sleep(0.4)
        assert counter(s) > a > 0
    finally:
        s.close()


def tree_digest(s) -> dict:
    data = s.download_tar("/workspace")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf.getmembers():
            body = tf.extractfile(m).read() if m.isfile() else m.linkname.encode()
            out[m.name] = (m.type, m.mode, hashlib.sha256(body).hexdigest())
    return out


def test_snapshot_restore_identical_tree(backend, template):
    need(backend, "bwrap", "gvisor")
    s = backend.create(SandboxSpec(template=template))
    try:
        s.exec("mkdir -p deep/er && echo one > deep/er/f && rm README && ln -s src/app.py link && chmod 700 deep")
        s.write_file("bin.dat", os.urandom(5000))
        snap = s.snapshot("fs")
        want = tree_digest(s)
        s.exec("echo changed > deep/er/f")  # later edits must not leak into the snapshot
        r = backend.restore(snap)
        try:
            assert tree_digest(r) == want
            assert "README" not in {e["name"] for e in r.list_dir()}
        finally:
            r.close()
            backend.delete_snapshot(snap)
    finally:
        s.close()


def test_forks_are_independent(backend):
    need(backend, "bwrap", "gvisor")
    s = backend.create(SandboxSpec())
    try:
        s.write_file("shared.txt", b"base")
        kids = s.fork(2)
        try:
            for i, k in enumerate(kids):
                k.write_file("shared.txt", f"child{i}".encode())
            assert [k.read_file("shared.txt") for k in kids] == [b"child0", b"child1"]
            assert s.read_file("shared.txt") == b"base"
            assert len({k.id for k in kids}) == 2
        finally:
            for k in kids:
                k.close()
    finally:
        s.close()
    with pytest.raises(ValueError):
        s.fork(17)


def test_gvisor_full_restore_keeps_process_state(backend):
    need(backend, "gvisor")
    s = start_counter(backend)
    try:
        wait_counting(s)
        snap = s.snapshot("full")
        at_snap = counter(s)
        r = backend.restore(snap)
        try:
            c = counter(r)
            assert c > 0  # /tmp is in the sandbox's memory: only a process image brings it back
            time.sleep(0.4)
            assert counter(r) > c  # and the loop itself is running again
        finally:
            r.close()
            backend.delete_snapshot(snap)
        assert at_snap > 0
    finally:
        s.close()


def test_background_exec_streams(backend):
    need(backend, "bwrap")
    s = backend.create(SandboxSpec())
    try:
        h = s.spawn("for i in 1 2 3; do echo line$i; sleep 0.05; done; exit 3")
        out, deadline = b"", time.monotonic() + 5
        while time.monotonic() < deadline:
            p = s.poll(h)
            out += p["stdout"]
            if not p["running"]:
                break
            time.sleep(0.05)
        assert out == b"line1\nline2\nline3\n" and p["exit_code"] == 3
    finally:
        s.close()


def test_bad_arguments_are_clear(backend):
    need(backend, "bwrap")
    with pytest.raises(ValueError, match="memory_bytes"):
        backend.create(SandboxSpec(limits=Limits(memory_bytes=1)))
    with pytest.raises(ValueError, match="network"):
        backend.create(SandboxSpec(network="host"))
    with backend.create(SandboxSpec()) as s:
        with pytest.raises(ValueError, match="cmd"):
            s.exec([])


# ---- the guest agent's channel and the files API under attack ------------------------------------------
HIJACK = r'''
import ctypes, json, os, socket, stat, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
def attempts(pid):
    """Ways a same-uid process reaches another's state and descriptors (and what it got through them)."""
    out, got = {}, []
    pidfd = libc.syscall(434, pid, 0)  # pidfd_open
    fds = [libc.syscall(438, pidfd, n, 0) for n in range(16)] if pidfd >= 0 else []  # pidfd_getfd
    got += [os.fstat(fd).st_mode for fd in fds if fd >= 0]
    out["pidfd_getfd"] = any(fd >= 0 for fd in fds)
    out["proc_fd"] = False  # opening its descriptors through /proc
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        names = []
    for n in names:
        try:
            fd = os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        out["proc_fd"] = True
        got.append(os.fstat(fd).st_mode)
        os.close(fd)
    try:
        os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
        out["mem"] = True
    except OSError:
        out["mem"] = False
    try:
        os.kill(pid, 0)  # could it be sent SIGKILL / SIGSTOP?
        out["signal"] = True
    except OSError:
        out["signal"] = False
    out["ptrace"] = libc.ptrace(16, pid, None, None) == 0  # PTRACE_ATTACH (last: it stops the target)
    if out["ptrace"]:
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    out["channels"] = sum(1 for m in got if stat.S_ISFIFO(m) or stat.S_ISSOCK(m))
    return out
pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
agent = [p for p in pids if cmdline(p).startswith(b"/usr/bin/python3") and b"guest_agent" in cmdline(p)]
init = [p for p in pids if cmdline(p).startswith(b"bwrap")]
own = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE)  # a same-uid process that IS open to it
res = {"agent": attempts(agent[0]), "init": [attempts(p) for p in init], "control": attempts(own.pid)}
try:
    socket.socket(socket.AF_UNIX).connect("/.k3chan/agent.sock")
    res["connect"] = True
except OSError:
    res["connect"] = False
print(json.dumps(res))
own.kill()
'''


FORGE = r'''
import base64, ctypes, json, os, stat
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fake = base64.b64encode(b"FORGED").decode()
line = (json.dumps({"ok": True, "nonce": "0" * 32, "rid": 1, "stdout": fake, "stderr": "", "exit_code": 0,
                    "signal": None, "timed_out": False, "truncated": False, "duration": 0.0, "data": fake})
        + "\n").encode()
written = 0
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    fds = []
    try:
        fds += [os.open(f"/proc/{p}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK) for n in os.listdir(f"/proc/{p}/fd")
                if stat.S_ISFIFO(os.stat(f"/proc/{p}/fd/{n}").st_mode)]
    except OSError:
        pass
    pidfd = libc.syscall(434, int(p), 0)
    if pidfd >= 0:
        fds += [fd for fd in (libc.syscall(438, pidfd, n, 0) for n in range(16)) if fd >= 0]
    for fd in fds:
        try:
            os.write(fd, line * 3)
            written += 1
        except OSError:
            pass
print("genuine", written)
'''


def test_forged_answers_never_reach_the_host(sb):
    """A command writes made-up answers into every pipe or socket of another process it can reach (the
    agent's, bwrap's init's): the host still gets the real result of each call."""
    r = sb.exec(["python3", "-c", FORGE])
    # what it wrote into its own output pipes is its output; the call's answer is the agent's, not a forgery
    assert r.exit_code == 0 and r.stdout != b"FORGED" and r.stdout.splitlines()[-1].startswith(b"genuine "), r
    assert sb.read_file("README") == b"template\n"
    assert sb.exec("echo after").stdout == b"after\n"


def test_commands_cannot_reach_the_agents_channel(sb):
    """Commands run under another uid than the agent (which is also non-dumpable and, on bwrap, the only
    holder of its channel): each way in that works on an ordinary same-uid process fails on the agent."""
    import json
    r = sb.exec(["python3", "-c", HIJACK])
    assert r.exit_code == 0, r
    res = json.loads(r.stdout)
    ways = ["pidfd_getfd", "proc_fd", "mem", "ptrace", "signal"]
    ctl, agent = res["control"], res["agent"]
    assert sum(ctl[w] for w in ways) >= 4 and ctl["channels"] >= 1, res  # gVisor lacks pidfd_getfd
    assert not any(agent[w] for w in ways) and agent["channels"] == 0, res
    for init in res["init"]:  # bwrap's init: as out of reach
        assert not any(init[w] for w in ways) and init["channels"] == 0, res
    assert not res["connect"], res  # and nobody listens for a second agent
    assert sb.exec("echo genuine").stdout == b"genuine\n" and sb.read_file("README") == b"template\n"


def test_fifo_or_device_through_files_api_fails_fast_and_sandbox_lives(sb):
    assert sb.exec("mkfifo /workspace/pipe /tmp/pipe && ln -s /workspace/pipe /workspace/pipelink").exit_code == 0
    took = []

    def refused(call, *args, match=None):
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match=match):
            call(*args)
        took.append(time.monotonic() - t0)

    try:
        for path in ("pipe", "/tmp/pipe", "pipelink", "/dev/zero", "/dev/null"):
            refused(sb.read_file, path, match="regular file")
        for path in ("pipe", "pipelink", "/dev/null"):
            refused(sb.write_file, path, b"x")
        if sb.backend_name == "bwrap":  # background exec
            reader = sb.spawn("cat /workspace/pipe > /dev/null")  # with a reader waiting the open succeeds...
            time.sleep(0.3)
            refused(sb.write_file, "pipe", b"x", match="regular file")  # ...but a FIFO is still refused
            sb.kill_process(reader)
        assert max(took) < 5, took  # each at once (a blocking open waited out the 30 s call timeout)
        assert sb.exec("echo alive").stdout == b"alive\n"
    finally:
        sb.exec("rm -f /workspace/pipe /tmp/pipe /workspace/pipelink")


def test_sandbox_host_mounts_are_nosuid_nodev(backend, sb):
    need(backend, "bwrap", "gvisor")
    mounts = hostfs.mounts_under(sb.dir)
    assert mounts
    for m in mounts:
        opts = [line.split()[3] for line in open("/proc/self/mounts") if line.split()[1] == m][0].split(",")
        assert "nosuid" in opts and "nodev" in opts, (m, opts)


def test_setuid_file_left_in_a_sandbox_is_inert_on_the_host(backend, tmp_path):
    need(backend, "bwrap")  # on gvisor the mount flags above cover its host-side files
    s = backend.create(SandboxSpec())
    try:
        assert s.exec("cp /usr/bin/id ./id && chmod 4755 ./id && ls -l ./id").stdout.startswith(b"-rws")
        host_copy = s.upper / "id"
        assert os.stat(host_copy).st_mode & 0o4000  # the bit is there, on a host path any local user can reach
        for m in hostfs.mounts_under(s.dir):
            opts = [line.split()[3] for line in open("/proc/self/mounts") if line.split()[1] == m][0].split(",")
            assert "nosuid" in opts and "nodev" in opts, (m, opts)
        snap = s.snapshot("fs")
        try:
            sealed = os.path.join(snap.layers[0], "id")
            assert not os.stat(sealed).st_mode & 0o6000
            for path in (host_copy, sealed):  # a local user runs it through its host path
                r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(path), "-u"],
                                   capture_output=True, text=True, timeout=10)
                assert r.stdout.strip() == "65534", (path, r)  # not the sandbox uid
        finally:
            backend.delete_snapshot(snap)
    finally:
        s.close()


def _tree_bytes(paths) -> int:
    total = 0
    for p in paths:
        for dirpath, _, files in os.walk(p):
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def test_fork_and_snapshot_layers_go_with_their_last_user(backend, tmp_path):
    need(backend, "bwrap", "gvisor")
    (tmp_path / "tpl.txt").write_text("a template only this test uses\n")
    s = backend.create(SandboxSpec(template=tmp_path))
    s.exec("head -c 3000000 /dev/urandom > blob")
    kids = s.fork(3)
    kid_layers = {p for k in kids for p in k.layers if os.path.basename(p) != "empty"}
    snap = s.snapshot("fs")
    layers = kid_layers | set(snap.layers) - {str(hostfs.state_root() / "layers" / "empty")}
    assert _tree_bytes(layers) >= 2 * 3000000  # the fork's layer and the snapshot's both hold the blob
    s.close()
    blobs = [k.read_file("blob") for k in kids]  # still readable after the parent closed
    assert len(blobs[0]) == 3000000 and blobs.count(blobs[0]) == 3
    for k in kids:
        k.close()
    assert _tree_bytes(kid_layers - set(snap.layers)) == 0  # the fork's layer went with the last child
    assert all(os.path.isdir(p) for p in snap.layers)  # the snapshot still holds its own (and the template)
    r = backend.restore(snap)
    assert len(r.read_file("blob")) == 3000000
    backend.delete_snapshot(snap)
    assert r.exec("wc -c < blob").text.strip() == "3000000"  # a restored sandbox keeps its layers meanwhile
    r.close()
    assert _tree_bytes(layers) == 0 and not any(os.path.exists(p) for p in layers)
    with pytest.raises(SandboxError, match="gone"):
        backend.restore(snap)  # a deleted snapshot cannot come back half-way


def test_gvisor_children_share_layers_and_copy_only_changes(backend):
    """A gVisor child starts on an overlay over its fork's sealed layer (its own disk stays empty), a snapshot
    of it copies only what changed (a deletion as an overlay whiteout), and its layers go when it closes."""
    need(backend, "gvisor")
    with backend.create(SandboxSpec()) as s:
        s.exec("head -c 1000000 /dev/urandom > blob && echo keep > small")
        kids = s.fork(1)
    kid = kids[0]
    fork_layers = [p for p in kid.layers if os.path.basename(p) != "empty"]
    try:
        assert kid.exec("wc -c < blob").text.strip() == "1000000"
        assert _tree_bytes([kid.upper]) == 0  # nothing copied in
        assert _tree_bytes(fork_layers) >= 1000000
        kid.exec("rm blob && echo new > fresh")
        snap = kid.snapshot("fs")
        try:
            assert _tree_bytes([snap.layers[0]]) < 100  # "new\n" and a whiteout, not the megabyte
            with backend.restore(snap) as r:
                assert sorted(e["name"] for e in r.list_dir()) == ["fresh", "small"]
        finally:
            backend.delete_snapshot(snap)
    finally:
        kid.close()
    assert _tree_bytes(fork_layers) == 0 and not any(os.path.exists(p) for p in fork_layers)


INOTIFY_HOG = ("import ctypes, sys, time\nlibc = ctypes.CDLL(None)\n"
               "fds = [libc.inotify_init() for _ in range(int(sys.argv[1]))]\n"
               "print(sum(fd >= 0 for fd in fds), flush=True)\ntime.sleep(60)\n")


def test_sandboxes_have_their_own_host_uid_and_per_uid_quotas(backend):
    """One sandbox takes every inotify instance its uid may have (a per-uid kernel quota); another sandbox
    still gets one, and no two sandboxes' processes share a host uid."""
    need(backend, "bwrap")
    quota = int(open("/proc/sys/fs/inotify/max_user_instances").read())
    if quota > 1000:
        pytest.skip(f"fs.inotify.max_user_instances={quota}: too many to exhaust in a test")
    a = backend.create(SandboxSpec(limits=Limits(open_files=quota + 64)))
    b = backend.create(SandboxSpec())
    try:
        h = a.spawn(["python3", "-c", INOTIFY_HOG, str(quota + 10)])
        out, deadline = b"", time.monotonic() + 20
        while not out.strip() and time.monotonic() < deadline:
            out += a.poll(h)["stdout"]
            time.sleep(0.05)
        assert 0 < int(out) < quota + 10, out  # it ran into the quota of its uid
        got = b.exec(["python3", "-c", "import ctypes; print(ctypes.CDLL(None).inotify_init())"]).text
        assert int(got) >= 0, got  # the other sandbox's uid has its own
        uids = []
        for s in (a, b):
            pids = s.cg.pids()
            assert pids
            uids.append({int(open(f"/proc/{p}/status").read().split("\nUid:")[1].split()[1]) for p in pids})
        assert uids[0].isdisjoint(uids[1]), uids
        assert hostfs.SANDBOX_UID not in uids[0] | uids[1]
    finally:
        a.close()
        b.close()


KEY_HOG = ("import ctypes, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\n"
           "while libc.syscall(248, b'user', f'k{n}'.encode(), b'x' * 100, 100, -2) >= 0:\n"  # add_key
           "    n += 1\nprint(n, ctypes.get_errno(), flush=True)\ntime.sleep(60)\n")


def test_one_sandbox_exhausting_its_key_quota_leaves_others_theirs(backend):
    """The kernel's key quota (kernel.keys.maxkeys / maxbytes) is per host uid: a command that fills it in one
    sandbox (keys in its process keyring, held while it sleeps) must not make add_key fail in another."""
    need(backend, "bwrap")
    a, b = backend.create(SandboxSpec()), backend.create(SandboxSpec())
    try:
        h = a.spawn(["python3", "-c", KEY_HOG])
        out, deadline = b"", time.monotonic() + 20
        while not out.strip() and time.monotonic() < deadline:
            out += a.poll(h)["stdout"]
            time.sleep(0.05)
        keys, err = map(int, out.split())
        assert keys > 0 and err == 122, out  # EDQUOT: its uid's quota is full
        one = b.exec(["python3", "-c", "import ctypes; print(ctypes.CDLL(None).syscall("
                      "248, b'user', b'mine', b'x' * 100, 100, -2))"]).text
        assert int(one) > 0, one  # a key serial: the other sandbox's uid has its own quota
    finally:
        a.close()
        b.close()


def test_env_secrets_never_on_a_command_line(backend):
    need(backend, "bwrap", "gvisor")
    secret = "tok-" + os.urandom(12).hex()
    with backend.create(SandboxSpec(env={"API_KEY": secret})) as s:
        assert s.exec("echo $API_KEY").text.strip() == secret  # the sandbox has it...
        seen = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    seen.append(open(f"/proc/{p}/cmdline", "rb").read())
                except OSError:
                    pass
        assert seen and not any(secret.encode() in c for c in seen)  # ...no process's argv on the host does


@pytest.mark.parametrize("env, match", [({"A": "x\0y"}, "NUL"), ({"A\0B": "x"}, "name"),
                                        ({"BIG": "x" * (4 << 20)}, "bytes"),
                                        ({f"V{i}": "x" * 100_000 for i in range(4)}, "totals")])
def test_bad_env_refused_before_anything_starts(backend, env, match, monkeypatch):
    """Refused before a sandbox id is even drawn (so no directory, layer hold or uid lease of its own). Watched
    through the id, not the state directory, which other test processes fill meanwhile."""
    need(backend, "bwrap")
    from k3.agentenv.backends import bwrap
    drawn, new_id = [], bwrap.new_id
    monkeypatch.setattr(bwrap, "new_id", lambda: drawn.append(new_id()) or drawn[-1])
    with pytest.raises(ValueError, match=match):
        backend.create(SandboxSpec(env=env))
    assert drawn == []
    backend.create(SandboxSpec()).close()  # the spy sees a real creation (so the check above could fail)
    assert len(drawn) == 1 and not (hostfs.state_root() / "sb" / drawn[0]).exists()


def test_host_side_failures_are_sandbox_errors(backend, tmp_path):
    need(backend, "bwrap")
    os.mkfifo(tmp_path / "pipe")  # a template the host cannot copy
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="cannot seal template"):
        backend.create(SandboxSpec(template=tmp_path))
    assert time.monotonic() - t0 < 10


def test_exec_env_checked(sb):
    with pytest.raises(ValueError, match="NUL"):
        sb.exec("true", env={"A": "b\0c"})
    assert sb.exec("echo $A", env={"A": "ok"}).stdout == b"ok\n"

