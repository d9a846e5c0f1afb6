"""gVisor backend: Debian's `runsc` with an OCI bundle (minimal rootfs, read-only /usr, bind-mounted workspace
on a sized tmpfs, `--network=none`), one `runsc exec` of the guest agent per call, `runsc pause/resume`, full
snapshots with process state through `runsc checkpoint`/`restore`, and fork by restoring one image n times.
The workspace is a host overlay over the shared sealed layers (as in bwrap), so start and restore copy nothing
and a snapshot copies only what changed; a sandbox holds its layers until it closes. Each `runsc exec` of the
guest agent gets its configuration and request on stdin and may print at most its answer's cap."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

from k3.agentenv import cgroups, channel, hostfs
from k3.agentenv.api import (Backend, ExecResult, Sandbox, SandboxError, SandboxSpec, Snapshot, check_argv_or_cmd,
                             check_env)

_avail: dict[str, tuple[bool, str]] = {}
RUNSC_MEMORY_OVERHEAD = 160 << 20  # sentry + gofer resident memory besides the guest's own pages
# Host pids backstop. Guest processes are bounded by RLIMIT_NPROC inside; on the host the ptrace platform adds
# stub processes and the Go runtime keeps every OS thread it ever made: a fork bomb capped at 32 guest
# processes was measured leaving ~770 host tasks, and a limit near that kills the whole sandbox.
RUNSC_PIDS_OVERHEAD = 4096
RUNSC_PIDS_PER_GUEST_TASK = 32
# pid 1 of the container: reaps orphans (a killed fork bomb's processes are re-parented to it; unreaped
# zombies would keep counting against RLIMIT_NPROC), otherwise sleeps.
REAPER = ("import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n"
          "        time.sleep(0.5)\n")


def _runsc_base(state: Path) -> list[str]:
    return ["runsc", "--root", str(state), "--network=none", "--platform=ptrace", "--ignore-cgroups",
            "--oci-seccomp"]


# The guest agent runs as the guest's root with just what it needs to start commands as SANDBOX_UID (which
# then cannot read its /proc files, signal or trace it) and to manage their files; all in gVisor's kernel.
AGENT_CAPS = [f"--cap={c}" for c in ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER",
                                     "CAP_KILL")]
_CLONE_NEWUSER = 0x10000000
_EPERM = 1


def _seccomp() -> dict:
    """OCI seccomp profile loaded inside gVisor's kernel (`--oci-seccomp`): everything allowed except making
    or joining namespaces. gVisor's kernel, like Linux, lets an unprivileged process create a user namespace
    (and so regain capabilities inside it); here unshare/clone with CLONE_NEWUSER, setns and clone3 (whose
    flags a filter cannot read) fail with EPERM / ENOSYS, so libc falls back to clone."""
    newuser = [{"index": 0, "value": _CLONE_NEWUSER, "valueTwo": _CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": [{"names": ["unshare", "clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM,
                          "args": newuser},
                         {"names": ["setns"], "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM},
                         {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]}


class GVisorBackend(Backend):
    name = "gvisor"

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else hostfs.state_root()

    def available(self) -> tuple[bool, str]:
        if "r" in _avail:
            return _avail["r"]
        if os.geteuid() != 0:
            _avail["r"] = (False, "runsc needs root here")
        elif not shutil.which("runsc"):
            _avail["r"] = (False, "runsc not installed (apt-get install runsc)")
        elif cgroups.detect()[0] == "":
            _avail["r"] = (False, f"no cgroups to hold the runsc sandbox: {cgroups.detect()[1]}")
        else:
            try:
                r = subprocess.run(["runsc", "--network=none", "--platform=ptrace", "--ignore-cgroups", "do", "true"],
                                   capture_output=True, timeout=60, cwd="/tmp")
                _avail["r"] = (True, "") if r.returncode == 0 else \
                    (False, f"runsc do true failed: {r.stderr.decode()[-300:].strip()}")
            except (OSError, subprocess.SubprocessError) as e:
                _avail["r"] = (False, f"runsc probe failed: {e}")
        return _avail["r"]

    def create(self, spec: SandboxSpec | None = None) -> "GVisorSandbox":
        spec = spec or SandboxSpec()
        spec.validate()
        self.require()
        hostfs.ensure_state(self.root)
        ref = "tplref-" + uuid.uuid4().hex[:12]
        base = hostfs.seal_template(spec.template, self.root, ref)
        try:  # held under `ref` until the sandbox holds it itself
            return GVisorSandbox(self, spec, [str(base)], image=None)
        finally:
            hostfs.release_layers(self.root, [base], ref)

    def restore(self, snap: Snapshot) -> "GVisorSandbox":
        if snap.backend != self.name:
            raise ValueError(f"snapshot is from backend {snap.backend!r}, not {self.name!r}")
        self.require()
        missing = [p for p in (*snap.layers, *([snap.image] if snap.image else [])) if not Path(p).is_dir()]
        if missing:
            raise SandboxError(f"snapshot was deleted: {missing[0]} is gone")
        return GVisorSandbox(self, snap.spec, list(snap.layers), image=snap.image)

    def delete_snapshot(self, snap: Snapshot) -> None:
        """Release the snapshot's layers and process image (deleted unless another holder remains)."""
        if snap.ref:
            hostfs.release_layers(self.root, [*snap.layers, *([snap.image] if snap.image else [])], snap.ref)

    def sweep(self) -> int:
        n = 0
        for d in sorted((self.root / "gv").glob("*")):
            if hostfs.owner_alive(d):
                continue
            subprocess.run([*_runsc_base(d / "state"), "delete", "-force", d.name], capture_output=True, timeout=30)
            rec = {}
            try:
                rec = json.loads((d / "owner.json").read_text())
                cgroups.SandboxCgroup(rec["cgroup_name"], rec["cgroup_version"], rec["cgroup_dirs"]).remove()
            except (OSError, ValueError, KeyError):
                pass
            hostfs.remove_tree(d)
            hostfs.release_layers(self.root, rec.get("layers", []), d.name)
            n += 1
        hostfs.collect_layers(self.root)
        return n


class GVisorSandbox(Sandbox):
    fork_level = "full"  # children copy the whole checkpoint image
    backend_name = "gvisor"

    def __init__(self, backend: GVisorBackend, spec: SandboxSpec, layers: list[str], image: str | None):
        self.backend, self.spec, self.layers = backend, spec, list(layers)
        self.id = "gv-" + uuid.uuid4().hex[:12]
        try:  # first: a snapshot deleted meanwhile fails here, with nothing to undo
            hostfs.acquire_layers(backend.root, self.layers, self.id)
        except FileNotFoundError as e:
            raise SandboxError(f"cannot start {self.id}: {e}") from None
        self.state = "creating"
        self._lock = threading.RLock()
        self._timer = None
        self.dir = backend.root / "gv" / self.id
        self.cg = cgroups.SandboxCgroup("k3gv-" + self.id, cgroups.detect()[0])
        self._cg_made = False
        try:
            self.dir.mkdir(parents=True)
            hostfs.write_owner(self.dir, {"cgroup_name": self.cg.name, "cgroup_version": self.cg.version,
                                          "cgroup_dirs": [str(d) for d in self.cg.dirs], "layers": self.layers})
            self._start(image)
        except BaseException as e:
            self.close()
            if isinstance(e, (OSError, subprocess.SubprocessError)):  # host plumbing: still a SandboxError
                raise SandboxError(f"sandbox {self.id} could not start: {e}") from e
            raise
        self.set_ttl(spec.ttl)

    def _runsc(self, *args, timeout=60, check=True, detached=False) -> subprocess.CompletedProcess:
        if detached:  # the container keeps the fds it inherits: give it a log file, not our pipes
            # runsc joins the sandbox's cgroup first, so its sandbox and gofer children start inside it
            # (a shell, not preexec_fn: this process has threads)
            join = 'for f in $K3_CG_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"'
            with open(self.dir / "runsc.log", "ab") as log:
                r = subprocess.run(["/bin/sh", "-c", join, "sh", *_runsc_base(self.dir / "state"), *args],
                                   stdout=log, stderr=log, stdin=subprocess.DEVNULL, timeout=timeout,
                                   env={**os.environ, "K3_CG_PROCS": " ".join(self.cg.procs_files())})
            err = (self.dir / "runsc.log").read_bytes()
        else:
            rc, out, err = channel.run_capped([*_runsc_base(self.dir / "state"), *args], b"", timeout, 1 << 20)
            r = subprocess.CompletedProcess(args, rc, out, err)
        if check and r.returncode != 0:
            raise SandboxError(f"runsc {args[0]} failed: {err.decode(errors='replace')[-400:].strip()}")
        return r

    def _start(self, image: str | None) -> None:
        lim = self.spec.limits
        if not self._cg_made:
            self._cg_made = True  # before create: close() then removes a half-made group too
            self.cg.create(lim.memory_bytes + RUNSC_MEMORY_OVERHEAD,
                           RUNSC_PIDS_OVERHEAD + RUNSC_PIDS_PER_GUEST_TASK * lim.pids, lim.cpus)
        disk, ws, rootfs = self.dir / "disk", self.dir / "ws", self.dir / "rootfs"
        for p in (disk, ws, rootfs):
            p.mkdir()
        hostfs.mount("tmpfs", disk, "tmpfs", f"size={lim.disk_bytes},mode=0755", hostfs.SANDBOX_MOUNT_FLAGS)
        # gVisor's gofer serves the workspace from a host overlay: the sealed layers (owned by SANDBOX_UID, the
        # uid in the guest) below, this sandbox's changes in `upper` on its sized tmpfs
        upper, work = disk / "upper", disk / "work"
        for p in (upper, work):
            p.mkdir()
        os.chown(upper, hostfs.SANDBOX_UID, hostfs.SANDBOX_UID)
        hostfs.mount("overlay", ws, "overlay", f"lowerdir={':'.join(self.layers)},upperdir={upper},workdir={work}",
                     hostfs.SANDBOX_MOUNT_FLAGS)
        for name in ("bin", "lib", "lib64", "sbin"):
            os.symlink(f"usr/{name}", rootfs / name)
        root = self.backend.root
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8", **self.spec.env}
        self.cfg = {"cpu_seconds": lim.cpu_seconds, "file_bytes": lim.disk_bytes, "open_files": lim.open_files,
                    "output_bytes": lim.output_bytes, "env": env, "deny_namespaces": True,
                    "command_uid": hostfs.SANDBOX_UID,
                    "nproc": lim.pids, "address_space_bytes": lim.memory_bytes}
        ro = ["ro", "rbind", "nosuid", "nodev"]
        config = {
            "ociVersion": "1.0.2",
            "process": {"terminal": False, "user": {"uid": hostfs.SANDBOX_UID, "gid": hostfs.SANDBOX_UID},
                        "args": ["/bin/sh", "-c", self.spec.metadata["init"]] if "init" in self.spec.metadata
                        else ["/usr/bin/python3", "-I", "-S", "-c", REAPER], "env": [f"{k}={v}" for k, v in env.items()],
                        "cwd": "/workspace", "capabilities": {k: [] for k in
                                                               ("bounding", "effective", "inheritable", "permitted")},
                        "noNewPrivileges": True,
                        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": lim.open_files, "soft": lim.open_files}]},
            "root": {"path": str(rootfs), "readonly": True},
            "hostname": "sandbox",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/usr", "type": "bind", "source": "/usr", "options": ro},
                {"destination": "/etc", "type": "bind", "source": str(root / "etc"), "options": ro},
                {"destination": "/.k3agent", "type": "bind", "source": str(root / "agent"), "options": ro},
                {"destination": "/workspace", "type": "bind", "source": str(ws),
                 "options": ["rw", "rbind", "nosuid", "nodev"]},
            ],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                      "resources": {"memory": {"limit": lim.memory_bytes}, "pids": {"limit": lim.pids}},
                      "seccomp": _seccomp()},
        }
        fd = os.open(self.dir / "config.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # env secrets
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(config))
        if image is None:
            self._runsc("run", "--bundle", str(self.dir), "-detach", self.id, detached=True)
        else:
            self._runsc("restore", "--image-path", image, "--bundle", str(self.dir), "-detach", self.id, detached=True)
        self.upper = upper
        self.state = "running"

    def _agent(self, op: str, wait: float = 60, **fields) -> dict:
        with self._lock:
            if self.state != "running":
                raise SandboxError(f"sandbox {self.id} is {self.state}")
            line, nonce = channel.new_request(op, **fields)
            lim = self.spec.limits
            payload = {"exec": 2 * lim.output_bytes, "read": 64 << 20, "tar_get": channel.MAX_TAR_BYTES}.get(op, 0)
            try:
                rc, out, err = channel.run_capped(
                    [*_runsc_base(self.dir / "state"), "exec", "--user", "0:0", *AGENT_CAPS,
                     self.id, "/usr/bin/python3", "-I", "-S", "/.k3agent/guest_agent.py", "--oneshot"],
                    (json.dumps(self.cfg) + "\n").encode() + line, wait, channel.max_answer_bytes(payload))
            except OSError as e:
                raise SandboxError(f"runsc exec failed: {e}") from None
        for ln in out.splitlines():  # lines without this call's nonce (written by a command) are skipped
            if nonce.encode() in ln:
                res = channel.parse_answer(ln, op, nonce)
                if res is not None:
                    return res
        gone = "" if self.alive() else "the sandbox is gone (killed, e.g. by its host memory limit); "
        raise SandboxError(f"guest agent gave no answer: {gone}{err.decode(errors='replace')[-300:]}")

    def exec(self, cmd, *, cwd="/workspace", env=None, stdin=b"", timeout=None) -> ExecResult:
        timeout = float(timeout if timeout is not None else self.spec.limits.exec_timeout)
        check_env(env or {}, "env")
        r = self._agent("exec", wait=timeout + 30, argv=check_argv_or_cmd(cmd), cwd=cwd, env=env or {},
                        timeout=timeout, stdin=channel.b64(stdin))
        return ExecResult(channel.b64field(r, "stdout"), channel.b64field(r, "stderr"), r["exit_code"], r["signal"],
                          r["timed_out"], r["truncated"], r["duration"])

    def read_file(self, path: str) -> bytes:
        return channel.b64field(self._agent("read", path=path), "data")

    def write_file(self, path: str, data: bytes, mode: int = 0o644, *, fresh: bool = False) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self._agent("write", path=path, data=channel.b64(data), mode=mode, fresh=fresh)

    def list_dir(self, path: str = "/workspace") -> list[dict]:
        return self._agent("list", path=path)["entries"]

    def download_tar(self, path: str = "/workspace") -> bytes:
        return channel.b64field(self._agent("tar_get", path=path), "data")

    def upload_tar(self, data: bytes, dest: str = "/workspace") -> None:
        self._agent("tar_put", data=channel.b64(data), dest=dest)

    def pause(self) -> None:
        with self._lock:
            if self.state == "running":
                self._runsc("pause", self.id)
                self.state = "paused"

    def resume(self) -> None:
        with self._lock:
            if self.state == "paused":
                self._runsc("resume", self.id)
                self.state = "running"

    def snapshot(self, level: str = "fs") -> Snapshot:
        """'fs': the workspace as a sealed layer; 'full': also every process's memory (`runsc checkpoint`,
        which stops this sandbox's container — it is restarted from the image so the sandbox carries on)."""
        if level not in ("fs", "full"):
            raise ValueError(f"level must be 'fs' or 'full', got {level!r}")
        with self._lock:
            was_paused = self.state == "paused"
            ref = f"snapref-{uuid.uuid4().hex[:12]}"
            if level == "fs":
                if not was_paused:
                    self._runsc("pause", self.id)
                try:
                    layer = hostfs.seal_upper(self.upper, self.backend.root, f"snap-{uuid.uuid4().hex[:12]}", ref)
                finally:
                    if not was_paused:
                        self._runsc("resume", self.id)
                hostfs.acquire_layers(self.backend.root, self.layers, ref)
                return Snapshot("gvisor", self.spec, (str(layer), *self.layers), "fs", ref=ref)
            image = hostfs.new_layer_dir(self.backend.root, f"img-{uuid.uuid4().hex[:12]}", ref)
            # checkpoint, then copy the workspace: the image must match the files it had open
            self._runsc("checkpoint", "--image-path", str(image), self.id, timeout=120)
            layer = hostfs.seal_upper(self.upper, self.backend.root, f"snap-{uuid.uuid4().hex[:12]}", ref)
            hostfs.acquire_layers(self.backend.root, self.layers, ref)
            self._runsc("delete", "-force", self.id, check=False)
            self._runsc("restore", "--image-path", str(image), "--bundle", str(self.dir), "-detach", self.id,
                        detached=True, timeout=120)
            self.state = "running"
            if was_paused:
                self.pause()
            return Snapshot("gvisor", self.spec, (str(layer), *self.layers), "full", str(image), ref=ref)

    def set_ttl(self, ttl: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if ttl is None:
            return
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl!r}")
        self._timer = threading.Timer(ttl, self.close if self.spec.on_expiry == "kill" else self._expire_pause)
        self._timer.daemon = True
        self._timer.start()

    def _expire_pause(self) -> None:
        try:
            self.pause()
        except SandboxError:
            pass

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.state in ("closing", "closed"):
            return
        self.state = "closing"
        try:
            self._runsc("delete", "-force", self.id, check=False, timeout=30)
        except (OSError, subprocess.SubprocessError, SandboxError):
            pass
        if self._cg_made:
            self.cg.remove()  # also whatever runsc left behind (a sandbox process whose delete failed)
        hostfs.remove_tree(self.dir)
        hostfs.release_layers(self.backend.root, self.layers, self.id)
        self.state = "closed"

    def alive(self) -> bool:
        """False once the sandbox is gone (closed, or its runsc processes were killed, e.g. by the host's
        memory limit)."""
        if self.state not in ("running", "paused"):
            return False
        try:
            r = self._runsc("state", self.id, check=False, timeout=30)
            return json.loads(r.stdout or b"{}").get("status") in ("running", "paused")
        except (OSError, ValueError, subprocess.SubprocessError, SandboxError):
            return False

    def memory_usage(self) -> int:
        """Host memory charged to the whole runsc sandbox (guest pages + runsc's own), in bytes."""
        return self.cg.memory_usage()
