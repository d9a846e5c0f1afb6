"""The default backend: Debian's bubblewrap, run as an unprivileged host uid, with every namespace unshared
(user, pid, net, ipc, uts, cgroup), no further user namespaces, read-only /usr, a minimal /etc, an overlay
workspace over a sealed shared template on a sized tmpfs (disk limit), cgroups nested under our own for
memory, pids, CPU bandwidth and the freezer (pause), and the stdlib guest agent speaking JSON lines on a pipe."""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

from k3.agentenv import cgroups, hostfs
from k3.agentenv.api import (Backend, ExecResult, Sandbox, SandboxError, SandboxSpec, Snapshot,
                             check_argv_or_cmd)

AGENT_START_TIMEOUT = 10.0
_sweep_done: set[str] = set()
_avail_cache: dict[str, tuple[bool, str]] = {}


def _probe() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root on the host (to mount overlay/tmpfs and create cgroups)"
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    if not bwrap:
        return False, "bwrap not installed (apt-get install bubblewrap)"
    if not setpriv:
        return False, "setpriv (util-linux) not installed"
    if not Path("/usr/bin/python3").exists():
        return False, "/usr/bin/python3 (system Python for the guest agent) missing"
    version, reason = cgroups.detect()
    if not version:
        return False, reason
    if "overlay" not in Path("/proc/filesystems").read_text():
        return False, "kernel has no overlay filesystem"
    r = subprocess.run([setpriv, f"--reuid={hostfs.SANDBOX_UID}", f"--regid={hostfs.SANDBOX_UID}", "--clear-groups",
                        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                        "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "true"],
                       capture_output=True, timeout=20)
    if r.returncode != 0:
        return False, f"bwrap cannot create namespaces as an unprivileged uid: {r.stderr.decode()[-300:].strip()}"
    return True, ""


class BwrapBackend(Backend):
    name = "bwrap"

    def __init__(self, root: str | Path | None = None, strip_git: bool = True):
        self.root = Path(root) if root else hostfs.state_root()
        self.strip_git = strip_git
        self._cg_version = ""

    def available(self) -> tuple[bool, str]:
        if "r" not in _avail_cache:
            try:
                _avail_cache["r"] = _probe()
            except (OSError, subprocess.SubprocessError) as e:
                _avail_cache["r"] = (False, f"probe failed: {e}")
        return _avail_cache["r"]

    def _setup(self) -> None:
        self.require()
        hostfs.ensure_state(self.root)
        self._cg_version = cgroups.detect()[0]
        if str(self.root) not in _sweep_done:
            _sweep_done.add(str(self.root))
            self.sweep()

    def create(self, spec: SandboxSpec | None = None) -> "BwrapSandbox":
        spec = spec or SandboxSpec()
        spec.validate()
        self._setup()
        base = hostfs.seal_template(spec.template, self.root, self.strip_git)
        return BwrapSandbox(self, spec, [str(base)])

    def restore(self, snap: Snapshot) -> "BwrapSandbox":
        if snap.backend != self.name:
            raise ValueError(f"snapshot is from backend {snap.backend!r}, not {self.name!r}")
        self._setup()
        return BwrapSandbox(self, snap.spec, list(snap.layers))

    def delete_snapshot(self, snap: Snapshot) -> None:
        """Remove a snapshot's own (newest) layer; sandboxes already restored from it keep their mounts."""
        if snap.layers and Path(snap.layers[0]).name.startswith("snap-"):
            shutil.rmtree(snap.layers[0], ignore_errors=True)

    def sweep(self) -> int:
        """Reclaim sandboxes whose owning process is gone: kill their cgroups, unmount, delete."""
        n = 0
        for d in sorted((self.root / "sb").glob("*")):
            if hostfs.owner_alive(d) or (not (d / "owner.json").exists() and time.time() - d.stat().st_mtime < 30):
                continue
            try:
                rec = json.loads((d / "owner.json").read_text())
                cg = cgroups.SandboxCgroup(rec["cgroup_name"], rec["cgroup_version"], rec["cgroup_dirs"])
                cg.remove()
            except (OSError, ValueError, KeyError):
                pass
            hostfs.remove_tree(d)
            n += 1
        return n


class BwrapSandbox(Sandbox):
    backend_name = "bwrap"

    def __init__(self, backend: BwrapBackend, spec: SandboxSpec, layers: list[str]):
        self.backend, self.spec, self.layers = backend, spec, list(layers)
        self.id = "sb-" + uuid.uuid4().hex[:12]
        self.state = "creating"
        self._lock = threading.RLock()
        self._close_lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.expires_at: float | None = None
        self.dir = backend.root / "sb" / self.id
        self.dir.mkdir()
        os.chmod(self.dir, 0o711)  # the sandbox uid must traverse to its bind sources; nothing else is readable
        self.cg = cgroups.SandboxCgroup("k3ae-" + self.id, backend._cg_version)
        hostfs.write_owner(self.dir, {"cgroup_name": self.cg.name, "cgroup_version": self.cg.version,
                                      "cgroup_dirs": [str(d) for d in self.cg.dirs]})
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self.set_ttl(spec.ttl)

    # ---- start-up ------------------------------------------------------------------------------------
    def _start(self) -> None:
        lim = self.spec.limits
        disk, ws = self.dir / "disk", self.dir / "ws"
        disk.mkdir()
        ws.mkdir()
        hostfs.mount("tmpfs", disk, "tmpfs", f"size={lim.disk_bytes},mode=0700,nr_inodes=65536")
        upper, work, scratch = disk / "upper", disk / "work", disk / "scratch"
        for p in (upper, work, scratch):
            p.mkdir()
            os.chown(p, hostfs.SANDBOX_UID, hostfs.SANDBOX_UID)
        os.chmod(disk, 0o755)
        os.chmod(scratch, 0o1777)
        hostfs.mount("overlay", ws, "overlay", f"lowerdir={':'.join(self.layers)},upperdir={upper},workdir={work}")
        self.upper = upper
        self.cg.create(lim.memory_bytes, lim.pids, lim.cpus)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8", "USER": "user",
               "TMPDIR": "/tmp", **self.spec.env}
        cfg = {"cpu_seconds": lim.cpu_seconds, "file_bytes": lim.disk_bytes, "open_files": lim.open_files,
               "output_bytes": lim.output_bytes, "env": env}
        root = self.backend.root
        bwrap = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                 "--uid", str(hostfs.INSIDE_UID), "--gid", str(hostfs.INSIDE_UID), "--hostname", "sandbox",
                 "--clearenv", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                 "--symlink", "usr/sbin", "/sbin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                 "--ro-bind", str(root / "etc"), "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--bind", str(scratch), "/tmp", "--bind", str(ws), "/workspace",
                 "--ro-bind", str(root / "agent"), "/.k3agent", "--remount-ro", "/", "--chdir", "/workspace",
                 "--setenv", "PATH", env["PATH"], "--setenv", "HOME", "/workspace",
                 "/usr/bin/python3", "-I", "-S", "/.k3agent/guest_agent.py", json.dumps(cfg)]
        # Join our cgroups as root, then drop to the sandbox uid and exec bwrap (no preexec_fn: threads).
        script = ('for f in $K3_CG_PROCS; do echo $$ > "$f" || exit 97; done; '
                  f'exec setpriv --reuid={hostfs.SANDBOX_UID} --regid={hostfs.SANDBOX_UID} --clear-groups -- "$@"')
        self._stderr = open(self.dir / "stderr.log", "wb")
        self.proc = subprocess.Popen(["/bin/sh", "-c", script, "sh", *bwrap], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, close_fds=True,
                                     env={"K3_CG_PROCS": " ".join(self.cg.procs_files()), "PATH": "/usr/bin:/bin"})
        self._buf = b""
        hello = self._read_line(time.monotonic() + AGENT_START_TIMEOUT)
        if not hello.get("ready"):
            raise SandboxError(f"guest agent did not start: {hello}")
        self.state = "running"

    # ---- transport -----------------------------------------------------------------------------------
    def _read_line(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if self.state == "paused":
                raise TimeoutError("sandbox was paused (TTL) while waiting")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("guest agent did not answer in time")
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    err = (self.dir / "stderr.log").read_bytes()[-500:].decode(errors="replace") \
                        if (self.dir / "stderr.log").exists() else ""
                    raise SandboxError(f"guest agent exited (sandbox {self.id}): {err.strip()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _call(self, op: str, wait: float = 30.0, **req) -> dict:
        with self._lock:
            if self.state in ("closing", "closed"):
                raise SandboxError(f"sandbox {self.id} is closed")
            if self.state == "paused":
                raise SandboxError(f"sandbox {self.id} is paused; resume() it first")
            self._rid = getattr(self, "_rid", 0) + 1
            try:
                self.proc.stdin.write((json.dumps({"op": op, "rid": self._rid, **req}) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise SandboxError(f"guest agent of {self.id} is gone") from None
            deadline = time.monotonic() + wait
            res = self._read_line(deadline)
            while res.get("rid") != self._rid:  # a late answer to a call we already gave up on
                res = self._read_line(deadline)
        if not res.pop("ok", False):
            raise SandboxError(f"{op} failed in sandbox: {res.get('error')}")
        return res

    # ---- exec and files ------------------------------------------------------------------------------
    def exec(self, cmd, *, cwd="/workspace", env=None, stdin=b"", timeout=None) -> ExecResult:
        argv = check_argv_or_cmd(cmd)
        timeout = float(timeout if timeout is not None else self.spec.limits.exec_timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        try:
            r = self._call("exec", wait=timeout + 10, argv=argv, cwd=cwd, env=env or {}, timeout=timeout,
                           stdin=base64.b64encode(stdin).decode())
        except TimeoutError:  # the agent itself stopped answering (e.g. the TTL froze the sandbox)
            return ExecResult(b"", b"sandbox stopped answering", None, None, True, False, timeout)
        return ExecResult(base64.b64decode(r["stdout"]), base64.b64decode(r["stderr"]), r["exit_code"], r["signal"],
                          r["timed_out"], r["truncated"], r["duration"])

    def spawn(self, cmd, *, cwd="/workspace", env=None) -> str:
        return self._call("spawn", argv=check_argv_or_cmd(cmd), cwd=cwd, env=env or {})["handle"]

    def poll(self, handle: str) -> dict:
        r = self._call("poll", handle=handle)
        r["stdout"], r["stderr"] = base64.b64decode(r["stdout"]), base64.b64decode(r["stderr"])
        return r

    def kill_process(self, handle: str) -> None:
        self._call("kill", handle=handle)

    def read_file(self, path: str) -> bytes:
        return base64.b64decode(self._call("read", path=path)["data"])

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self._call("write", path=path, data=base64.b64encode(data).decode(), mode=mode)

    def list_dir(self, path: str = "/workspace") -> list[dict]:
        return self._call("list", path=path)["entries"]

    def download_tar(self, path: str = "/workspace") -> bytes:
        return base64.b64decode(self._call("tar_get", wait=60, path=path)["data"])

    def upload_tar(self, data: bytes, dest: str = "/workspace") -> None:
        self._call("tar_put", wait=60, data=base64.b64encode(data).decode(), dest=dest)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def pause(self) -> None:
        with self._lock:
            if self.state == "running":
                self.cg.freeze()
                self.state = "paused"

    def resume(self) -> None:
        with self._lock:
            if self.state == "paused":
                self.cg.thaw()
                self.state = "running"
            if self.spec.ttl and self.expires_at is not None and time.time() >= self.expires_at:
                self.set_ttl(self.spec.ttl)  # a resumed sandbox gets a fresh TTL

    def snapshot(self, level: str = "fs") -> Snapshot:
        if level == "full":
            raise SandboxError("bwrap cannot save process state; snapshot(level='full') needs the gvisor backend")
        if level != "fs":
            raise ValueError(f"level must be 'fs' or 'full', got {level!r}")
        with self._lock:
            if self.state == "closed":
                raise SandboxError(f"sandbox {self.id} is closed")
            was_paused = self.state == "paused"
            if not was_paused:
                self.cg.freeze()  # a consistent tree: nothing writes while we copy
            try:
                layer = hostfs.seal_upper(self.upper, self.backend.root, f"snap-{uuid.uuid4().hex[:12]}")
            finally:
                if not was_paused:
                    self.cg.thaw()
        return Snapshot("bwrap", self.spec, (str(layer), *self.layers), "fs")

    def fork(self, n: int) -> list["BwrapSandbox"]:
        if not isinstance(n, int) or not 1 <= n <= 16:
            raise ValueError(f"n must be an integer in [1, 16], got {n!r}")
        snap = self.snapshot("fs")
        return [self.backend.restore(snap) for _ in range(n)]

    def set_ttl(self, ttl: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.expires_at = None
        if ttl is None:
            return
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl!r}")
        self.expires_at = time.time() + ttl
        self._timer = threading.Timer(ttl, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if self.spec.on_expiry == "kill":
            self.close()
        else:  # freeze without the lock: an exec in flight holds it and must see its agent stop answering
            if self.state == "running":
                self.cg.freeze()
                self.state = "paused"

    def memory_usage(self) -> int:
        return self.cg.memory_usage()

    def close(self) -> None:
        """Kill everything, unmount, delete. Idempotent; also safe half-way through creation."""
        if self._timer is not None:
            self._timer.cancel()
        with self._close_lock:
            if self.state in ("closing", "closed"):
                return
            self.state = "closing"
        self.cg.kill_all()
        proc = getattr(self, "proc", None)
        if proc is not None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if getattr(self, "_stderr", None):
            self._stderr.close()
        self.cg.remove()
        hostfs.remove_tree(self.dir)
        self.state = "closed"
