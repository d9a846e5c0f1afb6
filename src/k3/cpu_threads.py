"""CPU threads that hold up when other processes share the cores.

Beside one busy process on a 2-core machine a `tiny` training step went from ~1.3 s to 17-75 s
(benchmarks/RESULTS.md, "CPU contention"). A step runs thousands of small OpenMP parallel regions; each ends in a
barrier that waits for the slowest thread, and a thread that shares its core with another process waits a
scheduler time slice before it runs, so every region costs milliseconds instead of microseconds. OpenMP's
spin-waiting adds to it: libgomp's waiting threads spin 300,000 times (up to ~10 ms) before they sleep, burning
CPU time that the late thread or the other process needs.

k3 therefore, by default:
1. bounds libgomp's spin to 10,000 turns, then the thread sleeps (`GOMP_SPINCOUNT`), set in the environment by
   `import k3` before torch loads libgomp, which reads it once (`prepare_openmp_env`). Not a full sleep
   (`OMP_WAIT_POLICY=PASSIVE`): waking a sleeping thread costs ~16 us per parallel region on an idle machine,
   and a `tiny` step runs ~35,000 ops (benchmarks/RESULTS.md); a short spin keeps today's idle speed;
2. sizes torch's thread pool to the cores this process may use: its CPU affinity, capped by a cgroup CPU quota
   (`configure_torch_threads`, called by the `k3` command and the trainer);
3. while training, gives a thread back for each core another process is busy on, measured from /proc/stat
   over the last step, and takes it again once the core is free (`ThreadGovernor`).

An explicit choice wins: `K3_CPU_THREADS=N` (or `OMP_NUM_THREADS`/`MKL_NUM_THREADS`) fixes the count,
`OMP_WAIT_POLICY`/`GOMP_SPINCOUNT` keep the caller's values, a `torch.set_num_threads` made by the caller stops
k3 from changing the count, and `K3_CPU_THREADS=off` leaves threads and OpenMP as torch sets them. A thread count
that changes with the load can change float sums in their last bits (reductions split by thread): runs that must
match bit for bit (a `--resume` against an uninterrupted run) fix the count with `K3_CPU_THREADS=N`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

ENV = "K3_CPU_THREADS"
SPIN_COUNT = "10000"  # libgomp's default is 300000; 10000 turns still bridge the gap between back-to-back ops
# A core counts as taken once another process used this fraction of it over the last step: below it the
# barriers rarely wait; above it (a busy process gets >= half of a shared core) a thread on it costs more than it gives.
BUSY_CORE_FRACTION = 0.35

_k3_set_threads: int | None = None  # the count k3 itself gave torch last; anything else was the caller's


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # no affinity call on this platform
        return set(range(os.cpu_count() or 1))


# torch's own default count is one thread per core of the affinity when libgomp loads; k3 is imported about then
_startup_cpus = len(_affinity())


class ThreadSettingError(ValueError):
    """An unusable K3_CPU_THREADS value."""


@dataclasses.dataclass(frozen=True)
class ThreadPolicy:
    mode: str  # "auto": k3 adapts the count; "fixed": the user's count; "caller": torch's count set by the caller; "off"
    threads: int
    available: int  # cores this process may use


def requested_mode(environ=None) -> str | int:
    """K3_CPU_THREADS: "auto" (default), "off", or a positive thread count."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw == "off":
        return "off"
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ThreadSettingError(f"{ENV}={raw!r}: expected auto, off or a positive number of threads")


def prepare_openmp_env(environ=None) -> None:
    """Make waiting OpenMP threads spin briefly, then sleep. Only takes effect if run before libgomp loads
    (before `import torch`); `import k3` calls it. Leaves any wait setting of the user's alone."""
    environ = os.environ if environ is None else environ
    try:
        if requested_mode(environ) == "off":
            return
    except ThreadSettingError:
        return  # reported where the threads are configured, as one line, not as a traceback at import
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota where one is set."""
    n = len(_affinity())
    quota = _cgroup_cpu_quota()
    return max(1, min(n, math.ceil(quota)) if quota else n)


def _cgroup_cpu_quota() -> float | None:
    """CPUs granted by the cgroup's CFS quota (v2 cpu.max, v1 cfs_quota_us / cfs_period_us), or None."""
    for path, parse in (("/sys/fs/cgroup/cpu.max", lambda t: t.split()),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", None)):
        try:
            with open(path) as f:
                text = f.read()
            if parse:
                quota, period = parse(text)[:2]
            else:
                with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                    quota, period = text.strip(), f.read().strip()
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period)
        except (OSError, ValueError):
            continue
    return None


def _user_thread_count(environ) -> int | None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        first = environ.get(name, "").split(",")[0].strip()
        if first.isdigit() and int(first) >= 1:
            return int(first)
    return None


def configure_torch_threads(environ=None, accelerator: bool = False) -> ThreadPolicy:
    """Give torch the thread count of k3's policy (see the module docstring) and say which policy applies.

    accelerator: the process drives a GPU (an engine serving from one), so its CPU ops are the host's small
    index and list work, where OpenMP only wakes threads: "auto" gives torch one thread there. (A 16-element
    CPU `repeat_interleave` cost ~640 us at the pool's threads against ~15 us at one, measured in a serving step's
    layout code; vLLM's GPU workers run with OMP_NUM_THREADS=1 for the same reason.)"""
    import torch

    global _k3_set_threads
    environ = os.environ if environ is None else environ
    mode = requested_mode(environ)
    available = available_cpus()
    if mode == "off":
        return ThreadPolicy("off", torch.get_num_threads(), available)
    if isinstance(mode, int):
        _set_threads(mode)
        return ThreadPolicy("fixed", mode, available)
    user = _user_thread_count(environ)
    if user is not None:  # torch already took it at start-up
        return ThreadPolicy("fixed", torch.get_num_threads(), available)
    current = torch.get_num_threads()
    # any count other than torch's start-up default or k3's own was set by the caller
    if current != _k3_set_threads and current != _startup_cpus:
        return ThreadPolicy("caller", current, available)
    threads = 1 if accelerator else available
    _set_threads(threads)
    return ThreadPolicy("auto", threads, available)


def _set_threads(n: int) -> None:
    import torch

    global _k3_set_threads
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _k3_set_threads = n


def threads_for_load(available: int, foreign_cores: float) -> int:
    """Threads to run with when other processes keep `foreign_cores` cores busy: one fewer per taken core."""
    taken = math.floor(max(foreign_cores, 0.0) + 1.0 - BUSY_CORE_FRACTION)
    return max(1, min(available, available - taken))


def read_cpu_ticks(cpus, stat_text: str | None = None) -> tuple[int, int] | None:
    """Busy and total clock ticks so far of the given CPUs, summed, from /proc/stat (None where there is none).
    Busy counts everything but idle and iowait, including steal: time the hypervisor gave to someone else."""
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.read()
        except OSError:
            return None
    busy = total = 0
    seen = 0
    wanted = {f"cpu{c}" for c in cpus}
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
            seen += 1
    return (busy, total) if seen == len(wanted) else None


@dataclasses.dataclass(frozen=True)
class LoadSample:
    wall: float  # seconds, monotonic
    own_cpu: float  # this process's CPU seconds, all threads
    busy_ticks: int
    total_ticks: int


def sample_load(cpus) -> LoadSample | None:
    ticks = read_cpu_ticks(cpus)
    if ticks is None:
        return None
    return LoadSample(time.monotonic(), time.process_time(), *ticks)


def foreign_cores(before: LoadSample, after: LoadSample, ticks_per_s: float | None = None) -> float:
    """Cores that other processes kept busy, on average, between two samples: all busy time on our CPUs
    minus our own CPU time, over the wall time."""
    ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    busy = (after.busy_ticks - before.busy_ticks) / ticks_per_s
    return max(0.0, (busy - (after.own_cpu - before.own_cpu)) / wall)


class ThreadGovernor:
    """Re-chooses torch's thread count at each call (once per training step) from the load others put on our
    cores since the previous call. Does nothing unless the policy is "auto" and k3 still owns the count."""

    def __init__(self, policy: ThreadPolicy | None = None):
        self.policy = policy or configure_torch_threads()
        self.cpus = sorted(_affinity())
        self.threads = self.policy.threads
        self.last_foreign: float | None = None
        self._last = sample_load(self.cpus) if self.policy.mode == "auto" else None

    @property
    def active(self) -> bool:
        import torch
        return self._last is not None and torch.get_num_threads() == _k3_set_threads

    def poll(self, min_interval: float = 0.5) -> int:
        """update(), at most every `min_interval` seconds: cheap enough to call between layers, so that a step
        that starts at 2 threads when another process takes a core drops to 1 within that step (one step at
        2 threads beside a busy process measured 94 s against 4 s at 1)."""
        if self._last is not None and time.monotonic() - self._last.wall < min_interval:
            return self.threads
        return self.update()

    def update(self) -> int:
        """Measure since the last call, set the thread count, return it."""
        if not self.active:
            return self.threads
        now = sample_load(self.cpus)
        if now is None:
            return self.threads
        self.last_foreign = foreign_cores(self._last, now)
        self._last = now
        want = threads_for_load(self.policy.available, self.last_foreign)
        if want != self.threads:
            _set_threads(want)
            self.threads = want
        return self.threads


def torch_already_loaded() -> bool:
    """Whether libgomp was initialised before k3 could set its wait policy (the caller imported torch first)."""
    return "torch" in sys.modules
