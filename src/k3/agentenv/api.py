"""The sandbox API every backend implements: specs and limits, exec results, the Sandbox and Backend
interfaces, backend selection ("backend unavailable: reason"), and a warm SandboxPool."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path


class SandboxError(RuntimeError):
    """An operation on a sandbox failed (the sandbox is closed, the guest died, a path is refused...)."""


class SandboxTimeout(SandboxError):
    """The guest agent did not answer in time (the sandbox may be frozen by its TTL, or its agent wedged)."""


class BackendUnavailable(SandboxError):
    """The backend cannot run on this machine; the message starts with 'backend unavailable: '."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"backend unavailable: {name}: {reason}")
        self.backend, self.reason = name, reason


@dataclass(frozen=True)
class Limits:
    """Per-sandbox limits. Sizes in bytes, times in seconds; `cpus` is a CPU-bandwidth share (1.0 = one core)."""
    cpu_seconds: int = 60          # RLIMIT_CPU of every exec'd process
    memory_bytes: int = 256 << 20  # memory cgroup limit of the whole sandbox
    pids: int = 64                 # pids cgroup limit (RLIMIT_NPROC does not bind a uid-mapped root)
    disk_bytes: int = 64 << 20     # writable workspace + scratch size (and RLIMIT_FSIZE)
    output_bytes: int = 1 << 20    # stdout / stderr kept per exec; more kills the command
    open_files: int = 256          # RLIMIT_NOFILE
    cpus: float = 1.0              # CPU bandwidth (cgroup cpu quota)
    exec_timeout: float = 30.0     # default exec timeout

    def validate(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "pids", "disk_bytes", "output_bytes", "open_files"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Limits.{name} must be an integer >= 1, got {v!r}")
        if self.memory_bytes < 16 << 20:
            raise ValueError(f"Limits.memory_bytes must be >= 16 MiB, got {self.memory_bytes}")
        if not 0.01 <= float(self.cpus) <= 256:
            raise ValueError(f"Limits.cpus must be in [0.01, 256], got {self.cpus!r}")
        if not self.exec_timeout > 0:
            raise ValueError(f"Limits.exec_timeout must be > 0, got {self.exec_timeout!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. `template`: a host directory copied (read-only, shared) under /workspace; `network`:
    "none" (default: only a private loopback) — outbound network is not offered; `ttl`: seconds until
    `on_expiry` ("pause" or "kill") happens, None for no TTL."""
    template: str | Path | None = None
    limits: Limits = field(default_factory=Limits)
    env: dict = field(default_factory=dict)
    network: str = "none"
    ttl: float | None = None
    on_expiry: str = "pause"
    metadata: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.template is not None and not Path(self.template).is_dir():
            raise ValueError(f"SandboxSpec.template must be an existing directory, got {self.template!r}")
        if not isinstance(self.limits, Limits):
            raise TypeError(f"SandboxSpec.limits must be a Limits, got {type(self.limits).__name__}")
        self.limits.validate()
        check_env(self.env, "SandboxSpec.env")
        if self.network != "none":
            raise ValueError(f"SandboxSpec.network: only 'none' is offered (private loopback), got {self.network!r}")
        if self.ttl is not None and not self.ttl > 0:
            raise ValueError(f"SandboxSpec.ttl must be > 0 seconds or None, got {self.ttl!r}")
        if self.on_expiry not in ("pause", "kill"):
            raise ValueError(f"SandboxSpec.on_expiry must be 'pause' or 'kill', got {self.on_expiry!r}")


@dataclass
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int | None       # None when killed by a signal
    signal: int | None = None   # the signal that ended it
    timed_out: bool = False
    truncated: bool = False     # output went past Limits.output_bytes (the command was killed)
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


@dataclass
class Snapshot:
    """A sealed state: `layers` (host dirs, oldest last) on top of the template; `image` a backend's full
    process image (gvisor) or None; `spec` to recreate limits and env."""
    backend: str
    spec: SandboxSpec
    layers: tuple[str, ...]
    level: str = "fs"
    image: str | None = None
    created: float = field(default_factory=time.time)
    ref: str | None = None  # the name this snapshot holds its layers under (released by delete_snapshot)


MAX_ENV_ENTRY = (128 << 10) - 1  # Linux's MAX_ARG_STRLEN: a longer NAME=value makes every execve fail (E2BIG)
MAX_ENV_BYTES = 256 << 10        # all entries together, well inside ARG_MAX with room for argv


def check_env(env, what: str = "env") -> None:
    """Names without '=' or NUL, string values without NUL, each NAME=value and the whole set small enough
    that execve accepts it (otherwise every command in the sandbox would fail)."""
    if not isinstance(env, dict):
        raise ValueError(f"{what} must be a dict of names to strings, got {type(env).__name__}")
    total = 0
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise ValueError(f"{what}: bad variable name {k!r} (non-empty, no '=' or NUL)")
        if not isinstance(v, str) or "\0" in v:
            raise ValueError(f"{what}[{k!r}] must be a string without NUL bytes")
        size = len(k.encode()) + 1 + len(v.encode())
        if size > MAX_ENV_ENTRY:
            raise ValueError(f"{what}[{k!r}] is {size} bytes; at most {MAX_ENV_ENTRY} per NAME=value")
        total += size + 1
    if total > MAX_ENV_BYTES:
        raise ValueError(f"{what} totals {total} bytes; at most {MAX_ENV_BYTES}")


def check_argv_or_cmd(cmd) -> list[str]:
    """A shell string becomes ['/bin/sh', '-c', cmd]; a list must be non-empty strings."""
    if isinstance(cmd, str):
        if not cmd:
            raise ValueError("cmd must be a non-empty shell string or an argv list")
        return ["/bin/sh", "-c", cmd]
    if isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        return list(cmd)
    raise ValueError(f"cmd must be a non-empty shell string or a list of strings, got {cmd!r}")


class Sandbox:
    """One isolated environment. States: running, paused, closed. Paths are sandbox paths (relative ones are
    relative to /workspace) and are resolved inside the sandbox, never joined to host paths."""
    backend_name = "abstract"
    id: str
    spec: SandboxSpec
    state: str

    def exec(self, cmd, *, cwd: str = "/workspace", env: dict | None = None, stdin: bytes = b"",
             timeout: float | None = None) -> ExecResult:
        raise NotImplementedError

    def spawn(self, cmd, *, cwd: str = "/workspace", env: dict | None = None) -> str:
        """Start a background command; returns a handle for `poll` / `kill_process`."""
        raise NotImplementedError(f"{self.backend_name}: background exec is not supported")

    def poll(self, handle: str) -> dict:
        """{'stdout': new bytes, 'stderr': new bytes, 'running': bool, 'exit_code', 'signal'}."""
        raise NotImplementedError(f"{self.backend_name}: background exec is not supported")

    def kill_process(self, handle: str) -> None:
        raise NotImplementedError(f"{self.backend_name}: background exec is not supported")

    def read_file(self, path: str) -> bytes:
        raise NotImplementedError

    def write_file(self, path: str, data: bytes, mode: int = 0o644, *, fresh: bool = False) -> None:
        """Write a regular file (anything else at `path` is refused). `fresh`: create it anew, reached without
        following any symlink; whatever the sandbox left under that name is removed first."""
        raise NotImplementedError

    def list_dir(self, path: str = "/workspace") -> list[dict]:
        raise NotImplementedError

    def download_tar(self, path: str = "/workspace") -> bytes:
        raise NotImplementedError

    def upload_tar(self, data: bytes, dest: str = "/workspace") -> None:
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def snapshot(self, level: str = "fs") -> Snapshot:
        raise NotImplementedError

    fork_level = "fs"  # the snapshot level a fork copies

    def fork(self, n: int) -> list["Sandbox"]:
        """n children restored from one snapshot of this sandbox; the snapshot itself is deleted (the children
        hold what they need), and a failure part-way closes the children made so far."""
        if not isinstance(n, int) or not 1 <= n <= 16:
            raise ValueError(f"n must be an integer in [1, 16], got {n!r}")
        snap = self.snapshot(self.fork_level)
        kids: list[Sandbox] = []
        try:
            for _ in range(n):
                kids.append(self.backend.restore(snap))
        except BaseException:
            for k in kids:
                k.close()
            raise
        finally:
            self.backend.delete_snapshot(snap)
        return kids

    def set_ttl(self, ttl: float | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Backend:
    """Creates sandboxes. `available()` -> (ok, reason); `create` raises BackendUnavailable when not ok."""
    name = "abstract"

    def available(self) -> tuple[bool, str]:
        raise NotImplementedError

    def require(self) -> None:
        ok, reason = self.available()
        if not ok:
            raise BackendUnavailable(self.name, reason)

    def create(self, spec: SandboxSpec | None = None) -> Sandbox:
        raise NotImplementedError

    def restore(self, snap: Snapshot) -> Sandbox:
        raise NotImplementedError

    def sweep(self) -> int:
        """Reclaim leftovers of dead owners (sandboxes whose creating process is gone). Returns how many."""
        return 0


BACKEND_NAMES = ("bwrap", "gvisor", "firecracker")


def get_backend(name: str = "bwrap", **kwargs) -> Backend:
    """The backend called `name` (bwrap, gvisor, firecracker); check `.available()` before use."""
    if name == "bwrap":
        from k3.agentenv.backends.bwrap import BwrapBackend
        return BwrapBackend(**kwargs)
    if name == "gvisor":
        from k3.agentenv.backends.gvisor import GVisorBackend
        return GVisorBackend(**kwargs)
    if name == "firecracker":
        from k3.agentenv.backends.firecracker import FirecrackerBackend
        return FirecrackerBackend(**kwargs)
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")


def available_backends() -> dict[str, str]:
    """{name: "" if usable else the reason it is not}."""
    out = {}
    for name in BACKEND_NAMES:
        ok, reason = get_backend(name).available()
        out[name] = "" if ok else reason
    return out


class SandboxPool:
    """Keeps `size` warm sandboxes of one spec. `acquire` hands one out (creating if none is warm); `release`
    resets it to its template (a fresh sandbox from the template replaces it, the used one is closed) so no
    state leaks from one user to the next."""

    def __init__(self, backend: Backend, spec: SandboxSpec, size: int = 2):
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an integer >= 0, got {size!r}")
        spec.validate()
        self.backend, self.spec, self.size = backend, spec, size
        self._warm: list[Sandbox] = []
        self._lock = threading.Lock()
        self.fill()

    def fill(self) -> None:
        while True:
            with self._lock:
                if len(self._warm) >= self.size:
                    return
            sb = self.backend.create(self.spec)
            with self._lock:
                self._warm.append(sb)

    def acquire(self) -> Sandbox:
        with self._lock:
            if self._warm:
                return self._warm.pop()
        return self.backend.create(self.spec)

    def release(self, sb: Sandbox) -> None:
        sb.close()
        self.fill()

    def warm_count(self) -> int:
        with self._lock:
            return len(self._warm)

    def close(self) -> None:
        with self._lock:
            warm, self._warm = self._warm, []
        for sb in warm:
            sb.close()


def with_limits(spec: SandboxSpec, **changes) -> SandboxSpec:
    """A copy of `spec` with some limits changed."""
    return replace(spec, limits=replace(spec.limits, **changes))

