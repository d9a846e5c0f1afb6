"""The default backend: Debian's bubblewrap, run as unprivileged host uids of its own (leased per sandbox: one
for the guest agent, mapped to root inside with the six capabilities it needs, one for its commands, mapped
to uid 1000 with none; the shared layers are idmapped to the commands'), with every namespace unshared
(user, pid, net, ipc, uts, cgroup), no further user namespaces, read-only /usr, a minimal /etc, an overlay
workspace over a sealed shared template on a sized tmpfs (disk limit), cgroups nested under our own for
memory, pids, CPU bandwidth and the freezer (pause), and the stdlib guest agent speaking JSON lines on a pipe
over a Unix socket it connects to once at start (the host then stops listening): no other process in the
sandbox, bwrap's own init included, holds a descriptor of that channel. Its configuration, env secrets
included, goes down that socket, never on a command line. Mounts are nosuid,
nodev; snapshot layers are reference-counted and go with their last user."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

from k3.agentenv import cgroups, channel, hostfs, idmap
from k3.agentenv.api import (Backend, ExecResult, Sandbox, SandboxError, SandboxSpec, SandboxTimeout, Snapshot,
                             check_argv_or_cmd, check_env)

AGENT_START_TIMEOUT = 10.0
# what the guest agent (root in the sandbox's user namespace, nowhere else) keeps: start commands as uid 1000,
# signal them, and manage the files it writes for them
AGENT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
SEND_TIMEOUT = 60.0  # a request the agent does not take in this long means it is wedged
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
    return _probe_idmap()


def _probe_idmap() -> tuple[bool, str]:
    """Can this kernel and the state root's filesystem give a sandbox's layers an idmapped mount?"""
    parent = hostfs.state_root().parent
    parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=".k3-idmap-probe-", dir=parent))
    try:
        (d / "src").mkdir()
        (d / "dst").mkdir()
        fd = idmap.userns_mapping(hostfs.SANDBOX_UID, idmap.UID_BASE)
        try:
            idmap.idmapped_bind(d / "src", d / "dst", fd)
            hostfs.umount(d / "dst")
        finally:
            os.close(fd)
    except OSError as e:
        return False, f"cannot give each sandbox its own uid (idmapped mounts under {parent}): {e}"
    finally:
        hostfs.remove_tree(d)
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
        sid = new_id()
        try:
            base = hostfs.seal_template(spec.template, self.root, sid, self.strip_git)
        except OSError as e:  # e.g. a FIFO or unreadable file in the template
            raise SandboxError(f"cannot seal template {spec.template}: {str(e)[:300]}") from e
        try:
            return BwrapSandbox(self, spec, [str(base)], sid)
        except BaseException:
            hostfs.release_layers(self.root, [base], sid)
            raise

    def restore(self, snap: Snapshot) -> "BwrapSandbox":
        if snap.backend != self.name:
            raise ValueError(f"snapshot is from backend {snap.backend!r}, not {self.name!r}")
        self._setup()
        return BwrapSandbox(self, snap.spec, list(snap.layers))

    def delete_snapshot(self, snap: Snapshot) -> None:
        """Release the snapshot's hold on its layers: each goes once its last sandbox closes too."""
        if snap.ref:
            hostfs.release_layers(self.root, snap.layers, snap.ref)

    def sweep(self) -> int:
        """Reclaim sandboxes whose owning process is gone: kill their cgroups, unmount, delete."""
        n = 0
        for d in sorted((self.root / "sb").glob("*")):
            if hostfs.owner_alive(d) or (not (d / "owner.json").exists() and time.time() - d.stat().st_mtime < 30):
                continue
            rec = {}
            try:
                rec = json.loads((d / "owner.json").read_text())
                cg = cgroups.SandboxCgroup(rec["cgroup_name"], rec["cgroup_version"], rec["cgroup_dirs"])
                cg.remove()
            except (OSError, ValueError, KeyError):
                pass
            hostfs.remove_tree(d)
            hostfs.release_layers(self.root, rec.get("layers", []), d.name)
            idmap.release_uids(self.root, rec.get("uids", []))
            n += 1
        hostfs.collect_layers(self.root)  # e.g. snapshots held by a process that died
        return n


def new_id() -> str:
    return "sb-" + uuid.uuid4().hex[:12]


class BwrapSandbox(Sandbox):
    backend_name = "bwrap"

    def __init__(self, backend: BwrapBackend, spec: SandboxSpec, layers: list[str], sid: str | None = None):
        self.backend, self.spec, self.layers = backend, spec, list(layers)
        self.id = sid or new_id()
        try:  # before anything else: a snapshot deleted meanwhile fails here, with nothing to undo
            hostfs.acquire_layers(backend.root, self.layers, self.id)
        except FileNotFoundError as e:
            raise SandboxError(f"cannot start {self.id}: {e}") from None
        self.state = "creating"
        self.uid: int | None = None      # host uid of the guest agent (and of bwrap itself)
        self.cmd_uid: int | None = None  # host uid of the commands
        self._lock = threading.RLock()
        self._close_lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.expires_at: float | None = None
        self.dir = backend.root / "sb" / self.id
        self.dir.mkdir()
        os.chmod(self.dir, 0o711)  # the sandbox uid must traverse to its bind sources; nothing else is readable
        self.cg = cgroups.SandboxCgroup("k3ae-" + self.id, backend._cg_version)
        try:
            self.uid = idmap.lease_uid(backend.root, self.id)
            self.cmd_uid = idmap.lease_uid(backend.root, self.id)
            hostfs.write_owner(self.dir, {"cgroup_name": self.cg.name, "cgroup_version": self.cg.version,
                                          "cgroup_dirs": [str(d) for d in self.cg.dirs], "layers": self.layers,
                                          "uids": [self.uid, self.cmd_uid]})
            self._start()
        except BaseException as e:
            self.close()
            if isinstance(e, OSError):  # host plumbing (mount, cgroup, uid lease): still a SandboxError
                raise SandboxError(f"sandbox {self.id} could not start: {e}") from e
            raise
        self.set_ttl(spec.ttl)

    # ---- start-up ------------------------------------------------------------------------------------
    def _start(self) -> None:
        lim = self.spec.limits
        disk, ws = self.dir / "disk", self.dir / "ws"
        disk.mkdir()
        ws.mkdir()
        hostfs.mount("tmpfs", disk, "tmpfs", f"size={lim.disk_bytes},mode=0700,nr_inodes=65536",
                     hostfs.SANDBOX_MOUNT_FLAGS)
        upper, work, scratch = disk / "upper", disk / "work", disk / "scratch"
        for p in (upper, work, scratch):
            p.mkdir()
            os.chown(p, self.cmd_uid, self.cmd_uid)
        os.chmod(disk, 0o755)
        os.chmod(scratch, 0o1777)
        chan = self.dir / "chan"
        chan.mkdir(mode=0o700)
        os.chown(chan, self.uid, self.uid)
        lowers = self._idmapped_layers()
        hostfs.mount("overlay", ws, "overlay", f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}",
                     hostfs.SANDBOX_MOUNT_FLAGS)
        self.upper = upper
        self.cg.create(lim.memory_bytes, lim.pids, lim.cpus)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8", "USER": "user",
               "TMPDIR": "/tmp", **self.spec.env}
        cfg = {"cpu_seconds": lim.cpu_seconds, "file_bytes": lim.disk_bytes, "open_files": lim.open_files,
               "output_bytes": lim.output_bytes, "env": env, "command_uid": hostfs.INSIDE_UID,
               "deny_namespaces": True}  # (bwrap's --disable-userns cannot go with a given namespace)
        root = self.backend.root
        userns = idmap.user_namespace([(0, self.uid), (hostfs.INSIDE_UID, self.cmd_uid)], owner=self.uid)
        bwrap = ["bwrap", "--userns", str(userns), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--uid", "0", "--gid", "0",
                 *[a for c in AGENT_CAPS for a in ("--cap-add", c)], "--hostname", "sandbox",
                 "--clearenv", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                 "--symlink", "usr/sbin", "/sbin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                 "--ro-bind", str(root / "etc"), "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--bind", str(scratch), "/tmp", "--bind", str(ws), "/workspace",
                 "--ro-bind", str(root / "agent"), "/.k3agent", "--ro-bind", str(chan), "/.k3chan",
                 "--remount-ro", "/", "--chdir", "/workspace",
                 "--setenv", "PATH", env["PATH"], "--setenv", "HOME", "/workspace",
                 "/usr/bin/python3", "-I", "-S", "/.k3agent/guest_agent.py", "--connect", "/.k3chan/agent.sock"]
        # Join our cgroups as root, then drop to the sandbox uid and exec bwrap (no preexec_fn: threads).
        script = ('for f in $K3_CG_PROCS; do echo $$ > "$f" || exit 97; done; '
                  f'exec setpriv --reuid={self.uid} --regid={self.uid} --clear-groups -- "$@"')
        self._stderr = open(self.dir / "stderr.log", "wb")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(chan / "agent.sock"))
            os.chown(chan / "agent.sock", self.uid, self.uid)
            listener.listen(1)
            self.proc = subprocess.Popen(["/bin/sh", "-c", script, "sh", *bwrap], stdin=subprocess.DEVNULL,
                                         stdout=self._stderr, stderr=self._stderr, close_fds=True, pass_fds=(userns,),
                                         env={"K3_CG_PROCS": " ".join(self.cg.procs_files()), "PATH": "/usr/bin:/bin"})
            self._conn = self._accept_agent(listener)
        finally:  # one connection ever: a command started later finds nobody listening
            os.close(userns)
            listener.close()
            (chan / "agent.sock").unlink(missing_ok=True)
        self._reader = channel.LineReader(self._conn.fileno(), 1 << 16, self._exit_reason)
        self._send((json.dumps(cfg) + "\n").encode())
        hello = self._reader.read_line(time.monotonic() + AGENT_START_TIMEOUT)
        try:
            ready = json.loads(hello).get("ready") is True
        except (ValueError, AttributeError):
            ready = False
        if not ready:
            raise SandboxError(f"guest agent did not start: {hello[:300]!r}")
        self.state = "running"

    def _idmapped_layers(self) -> list[str]:
        """Each shared layer bound under this sandbox's dir, its files shown as owned by this sandbox's uid."""
        nsfd = idmap.userns_mapping(hostfs.SANDBOX_UID, self.cmd_uid)
        try:
            out = []
            for i, layer in enumerate(self.layers):
                target = self.dir / "lower" / str(i)
                target.mkdir(parents=True)
                idmap.idmapped_bind(layer, target, nsfd)
                out.append(str(target))
            return out
        finally:
            os.close(nsfd)

    # ---- transport -----------------------------------------------------------------------------------
    def _exit_reason(self) -> str:
        log = self.dir / "stderr.log"
        err = log.read_bytes()[-500:].decode(errors="replace").strip() if log.exists() else ""
        return f" (sandbox {self.id}): {err}"

    def _accept_agent(self, listener: socket.socket) -> socket.socket:
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        listener.settimeout(0.2)
        while True:
            try:
                conn, _ = listener.accept()
                break
            except socket.timeout:
                if self.proc.poll() is not None:
                    raise SandboxError(f"sandbox exited before its agent connected{self._exit_reason()}") from None
                if time.monotonic() > deadline:
                    raise SandboxError(f"guest agent of {self.id} did not connect in time") from None
        conn.settimeout(SEND_TIMEOUT)  # sends only; answers are read with select
        return conn

    def _send(self, data: bytes) -> None:
        try:
            self._conn.sendall(data)
        except (OSError, ValueError):  # the agent died, stopped reading, or close() shut the socket
            raise SandboxError(f"guest agent of {self.id} is gone") from None

    def _stop_if_paused(self) -> None:
        if self.state == "paused":
            raise SandboxTimeout(f"sandbox {self.id} was paused (TTL) while waiting")

    def _answer_cap(self, op: str, req: dict) -> int:
        lim = self.spec.limits
        payload = {"exec": 2 * lim.output_bytes, "poll": 2 * lim.output_bytes, "read": req.get("max_bytes", 64 << 20),
                   "tar_get": channel.MAX_TAR_BYTES}.get(op, 0)
        return channel.max_answer_bytes(payload)

    def _call(self, op: str, wait: float = 30.0, **req) -> dict:
        with self._lock:
            if self.state in ("closing", "closed"):
                raise SandboxError(f"sandbox {self.id} is closed")
            if self.state == "paused":
                raise SandboxError(f"sandbox {self.id} is paused; resume() it first")
            line, nonce = channel.new_request(op, **req)
            self._send(line)
            deadline = time.monotonic() + wait
            self._reader.max_line = self._answer_cap(op, req)
            while True:  # answers with another nonce are late ones to calls we already gave up on
                try:
                    res = channel.parse_answer(self._reader.read_line(deadline, self._stop_if_paused), op, nonce)
                except SandboxTimeout:
                    raise
                except SandboxError as e:
                    if "channel closed" in str(e):  # an oversized answer: the channel cannot be trusted again
                        self.close()
                    raise
                if res is not None:
                    return res

    # ---- exec and files ------------------------------------------------------------------------------
    def exec(self, cmd, *, cwd="/workspace", env=None, stdin=b"", timeout=None) -> ExecResult:
        argv = check_argv_or_cmd(cmd)
        timeout = float(timeout if timeout is not None else self.spec.limits.exec_timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        check_env(env or {}, "env")
        try:
            r = self._call("exec", wait=timeout + 10, argv=argv, cwd=cwd, env=env or {}, timeout=timeout,
                           stdin=channel.b64(stdin))
        except SandboxTimeout:  # the agent itself stopped answering (e.g. the TTL froze the sandbox)
            return ExecResult(b"", b"sandbox stopped answering", None, None, True, False, timeout)
        return ExecResult(channel.b64field(r, "stdout"), channel.b64field(r, "stderr"), r["exit_code"], r["signal"],
                          r["timed_out"], r["truncated"], r["duration"])

    def spawn(self, cmd, *, cwd="/workspace", env=None) -> str:
        check_env(env or {}, "env")
        return self._call("spawn", argv=check_argv_or_cmd(cmd), cwd=cwd, env=env or {})["handle"]

    def poll(self, handle: str) -> dict:
        r = self._call("poll", handle=handle)
        r["stdout"], r["stderr"] = channel.b64field(r, "stdout"), channel.b64field(r, "stderr")
        return r

    def kill_process(self, handle: str) -> None:
        self._call("kill", handle=handle)

    def read_file(self, path: str) -> bytes:
        return channel.b64field(self._call("read", path=path), "data")

    def write_file(self, path: str, data: bytes, mode: int = 0o644, *, fresh: bool = False) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self._call("write", path=path, data=channel.b64(data), mode=mode, fresh=fresh)

    def list_dir(self, path: str = "/workspace") -> list[dict]:
        return self._call("list", path=path)["entries"]

    def download_tar(self, path: str = "/workspace") -> bytes:
        return channel.b64field(self._call("tar_get", wait=60, path=path), "data")

    def upload_tar(self, data: bytes, dest: str = "/workspace") -> None:
        self._call("tar_put", wait=60, data=channel.b64(data), dest=dest)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def pause(self) -> None:
        with self._lock:
            if self.state == "running":
                self._freeze()
                self.state = "paused"

    def _freeze(self) -> None:
        try:
            self.cg.freeze()
        except OSError as e:
            raise SandboxError(f"cannot pause {self.id}: {e}") from e

    def resume(self) -> None:
        with self._lock:
            if self.state == "paused":
                try:
                    self.cg.thaw()
                except OSError as e:
                    raise SandboxError(f"cannot resume {self.id}: {e}") from e
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
                self._freeze()  # a consistent tree: nothing writes while we copy
            ref = f"snapref-{uuid.uuid4().hex[:12]}"
            try:
                layer = hostfs.seal_upper(self.upper, self.backend.root, f"snap-{uuid.uuid4().hex[:12]}", ref)
                hostfs.acquire_layers(self.backend.root, self.layers, ref)
            except OSError as e:
                raise SandboxError(f"snapshot of {self.id} failed: {e}") from None
            finally:
                if not was_paused:
                    self.cg.thaw()
        return Snapshot("bwrap", self.spec, (str(layer), *self.layers), "fs", ref=ref)

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
                try:
                    self.cg.freeze()
                except OSError:  # a timer thread has nobody to tell: kill rather than leave it running
                    self.close()
                    return
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
            conn = getattr(self, "_conn", None)
            if conn is not None:
                conn.close()
        if getattr(self, "_stderr", None):
            self._stderr.close()
        self.cg.remove()
        hostfs.remove_tree(self.dir)
        hostfs.release_layers(self.backend.root, self.layers, self.id)
        idmap.release_uids(self.backend.root, [u for u in (self.uid, self.cmd_uid) if u is not None])
        self.state = "closed"
