"""Per-sandbox cgroups nested under the calling process's own cgroup (v1 or v2): memory, pids, CPU
bandwidth and the freezer. Processes are only ever moved into groups we created, never to siblings or root."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CG_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "freezer", "cpu")


def own_cgroups() -> dict[str, str]:
    """{controller or '' for the v2 hierarchy: path of this process's cgroup}."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in (ctrls.split(",") if ctrls else [""]):
            out[c] = path
    return out


def detect() -> tuple[str, str]:
    """('v1', '') or ('v2', '') when usable, else ('', reason)."""
    try:
        own = own_cgroups()
    except OSError as e:
        return "", f"cannot read /proc/self/cgroup: {e}"
    if all(c in own for c in V1_CONTROLLERS):
        missing = [c for c in V1_CONTROLLERS if not (CG_ROOT / c / own[c].lstrip("/")).is_dir()]
        if missing:
            return "", f"cgroup v1 controllers not mounted: {missing}"
        return "v1", ""
    if "" in own and (CG_ROOT / "cgroup.controllers").is_file():
        base = CG_ROOT / own[""].lstrip("/")
        avail = set((base / "cgroup.controllers").read_text().split())
        need = {"memory", "pids", "cpu"}
        if not need <= avail:
            return "", f"cgroup v2: controllers {sorted(need - avail)} not delegated to {base}"
        return "v2", ""
    return "", "no usable cgroup hierarchy (need v1 memory/pids/freezer/cpu or v2 memory/pids/cpu)"


class SandboxCgroup:
    """The cgroup(s) of one sandbox: `paths()` for cgroup.procs, `freeze()`/`thaw()`, `kill_all()`, `remove()`."""

    def __init__(self, name: str, version: str, dirs: list[str] | None = None):
        self.name, self.version = name, version
        if dirs is not None:  # re-opened by a sweep
            self.dirs = [Path(d) for d in dirs]
            return
        own = own_cgroups()
        if version == "v1":
            self.dirs = [CG_ROOT / c / own[c].lstrip("/") / name for c in V1_CONTROLLERS]
        else:
            base = CG_ROOT / own[""].lstrip("/")
            self._enable_v2(base)
            self.dirs = [base / name]

    @staticmethod
    def _enable_v2(base: Path) -> None:
        ctl = base / "cgroup.subtree_control"
        have = set(ctl.read_text().split())
        for c in ("memory", "pids", "cpu"):
            if c not in have:
                try:
                    ctl.write_text(f"+{c}")
                except OSError as e:
                    raise OSError(f"cgroup v2: cannot enable {c} under {base} ({e}); the calling process's own "
                                  "cgroup must have no member processes, or delegate a child group") from e

    def _dir(self, controller: str) -> Path:
        if self.version == "v2":
            return self.dirs[0]
        return self.dirs[V1_CONTROLLERS.index(controller)]

    def create(self, memory_bytes: int, pids: int, cpus: float) -> None:
        for d in self.dirs:
            d.mkdir(exist_ok=False)
        if self.version == "v1":
            mem = self._dir("memory")
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():
                try:
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                except OSError:
                    pass
            (self._dir("pids") / "pids.max").write_text(str(pids))
            cpu = self._dir("cpu")
            period = int((cpu / "cpu.cfs_period_us").read_text())
            (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * cpus))))
        else:
            d = self.dirs[0]
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(pids))
            (d / "cpu.max").write_text(f"{max(1000, int(100000 * cpus))} 100000")

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self._dir("pids") / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def freeze(self) -> None:
        if self.version == "v1":
            f = self._dir("freezer") / "freezer.state"
            f.write_text("FROZEN")
            for _ in range(500):  # FREEZING -> FROZEN takes a moment; bounded
                if f.read_text().strip() == "FROZEN":
                    return
                time.sleep(0.002)
            raise OSError("cgroup freezer did not reach FROZEN")
        (self.dirs[0] / "cgroup.freeze").write_text("1")
        for _ in range(500):
            if "frozen 1" in (self.dirs[0] / "cgroup.events").read_text():
                return
            time.sleep(0.002)
        raise OSError("cgroup v2 freeze did not complete")

    def thaw(self) -> None:
        if self.version == "v1":
            (self._dir("freezer") / "freezer.state").write_text("THAWED")
        else:
            (self.dirs[0] / "cgroup.freeze").write_text("0")

    def memory_usage(self) -> int:
        f = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        try:
            return int((self._dir("memory") / f).read_text())
        except OSError:
            return 0

    def kill_all(self, timeout: float = 5.0) -> bool:
        """SIGKILL every member (frozen first so nothing forks in between); True when the group is empty."""
        if self.version == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return True
            try:
                self.freeze()
            except OSError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.thaw()
            except OSError:
                pass
            time.sleep(0.01)
        return not self.pids()

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
