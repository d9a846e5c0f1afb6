"""k3's CPU thread policy (k3.cpu_threads): the rule, the /proc/stat arithmetic, and, in fresh processes (OpenMP
reads its environment once, at load), what `import k3` and the policy do to torch and libgomp for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from k3.cpu_threads import (LoadSample, ThreadSettingError, foreign_cores, prepare_openmp_env, read_cpu_ticks,
                            requested_mode, threads_for_load)

CPUS = sorted(os.sched_getaffinity(0))
THREAD_VARIABLES = ("K3_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def test_a_thread_is_given_back_for_each_core_another_process_keeps_busy():
    assert threads_for_load(2, 0.0) == 2
    assert threads_for_load(2, 0.2) == 2  # a light background job: its barriers rarely wait
    assert threads_for_load(2, 0.5) == 1  # a busy process sharing our second core gets at least half of it
    assert threads_for_load(2, 1.0) == 1
    assert threads_for_load(2, 5.0) == 1  # never fewer than one
    assert threads_for_load(16, 2.0) == 14
    assert threads_for_load(16, 1.5) == 14  # one full core and half of another
    assert threads_for_load(4, -0.01) == 4  # tick rounding can make the estimate slightly negative


STAT = """cpu  900 0 300 5000 20 0 10 0 0 0
cpu0 400 10 100 2500 10 0 5 1 0 0
cpu1 500 0 200 2500 10 0 5 7 0 0
intr 12345
"""


def test_cpu_ticks_sum_the_chosen_cpus_and_count_all_but_idle_and_iowait():
    assert read_cpu_ticks([0], STAT) == (400 + 10 + 100 + 5 + 1, 400 + 10 + 100 + 2500 + 10 + 5 + 1)
    assert read_cpu_ticks([0, 1], STAT) == (516 + 712, 3026 + 3222)
    assert read_cpu_ticks([0, 2], STAT) is None  # a CPU /proc/stat does not list: no estimate rather than a wrong one


def test_foreign_load_is_busy_time_minus_our_own_over_wall_time():
    before = LoadSample(wall=10.0, own_cpu=3.0, busy_ticks=1000, total_ticks=5000)
    after = LoadSample(wall=12.0, own_cpu=4.5, busy_ticks=1350, total_ticks=5400)  # 3.5 s busy, 1.5 s ours, 2 s
    assert foreign_cores(before, after, ticks_per_s=100) == pytest.approx(1.0)
    assert foreign_cores(before, before, ticks_per_s=100) == 0.0


def test_openmp_spin_is_bounded_unless_the_user_chose_a_wait_policy():
    env = {}
    prepare_openmp_env(env)
    assert env == {"GOMP_SPINCOUNT": "10000"}
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}, {"K3_CPU_THREADS": "off"},
                  {"K3_CPU_THREADS": "nonsense"}):
        env = dict(given)
        prepare_openmp_env(env)
        assert env == given


def test_bad_thread_setting_names_the_variable():
    assert requested_mode({}) == "auto" and requested_mode({"K3_CPU_THREADS": "3"}) == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ThreadSettingError, match=f"K3_CPU_THREADS='{bad}'"):
            requested_mode({"K3_CPU_THREADS": bad})


def _start(body: str, env: dict | None = None, cpus=None) -> subprocess.Popen:
    """Starts `body` in a new interpreter (after `import k3`, then torch) with a clean threading environment;
    body sets `result`, which _result reads back as a dict (from _finish's outcome)."""
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    clean.update(env or {})
    code = "import json, os, sys, time\nimport k3\nimport torch\nfrom k3 import cpu_threads\n" + \
           textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen([sys.executable, "-c", code], env=clean, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _result(finished: tuple[int, str, str]) -> dict:
    returncode, out, err = finished
    assert returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def _fresh_process(body: str, env: dict | None = None, cpus=None) -> dict:
    return _result(_finish(_start(body, env, cpus)))


POLICY = """
policy = cpu_threads.configure_torch_threads()
result = {"mode": policy.mode, "threads": torch.get_num_threads(),
          "wait": [os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")]}
"""


POLICY_CASES = [pytest.param(*case) for case in [
    ({}, "auto", len(CPUS), [None, "10000"]),
    ({"OMP_NUM_THREADS": "1"}, "fixed", 1, [None, "10000"]),
    ({"K3_CPU_THREADS": "1"}, "fixed", 1, [None, "10000"]),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "auto", len(CPUS), ["ACTIVE", None]),
    ({"K3_CPU_THREADS": "off", "OMP_NUM_THREADS": "1"}, "off", 1, [None, None]),
]]


AFFINITY = f"os.sched_setaffinity(0, {{{CPUS[0]}}})\n" + POLICY
CALLER_THREADS = 1 if len(CPUS) > 1 else 2
CALLER = f"torch.set_num_threads({CALLER_THREADS})\n" + POLICY + """
governor = cpu_threads.ThreadGovernor()
result["governed"] = [governor.active, governor.update()]
"""


# a GPU-serving process: the k3 command's policy first, then the engine's (cuda) call
ACCELERATOR = """
first = cpu_threads.configure_torch_threads().threads
policy = cpu_threads.configure_torch_threads(accelerator=True)
result = {"first": first, "mode": policy.mode, "threads": torch.get_num_threads()}
"""


@pytest.fixture(scope="module")
def policies() -> dict:
    """The policy tests' fresh processes, started together: the policy reads no load at start (only the
    governor's updates do, which these never run), and each process spends seconds importing torch while a
    core sits idle. Keyed by the policy case's environment (JSON), "affinity" and "caller"; each test reads (and
    fails on) its own process's outcome."""
    procs = {json.dumps(case.values[0]): _start(POLICY, case.values[0]) for case in POLICY_CASES}
    procs["caller"] = _start(CALLER)
    procs["accelerator"] = _start(ACCELERATOR)
    procs["accelerator fixed"] = _start(ACCELERATOR, {"K3_CPU_THREADS": "2"})
    if len(CPUS) >= 2:
        procs["affinity"] = _start(AFFINITY)
    return {key: _finish(proc) for key, proc in procs.items()}


@pytest.mark.parametrize("env, mode, threads, wait", POLICY_CASES)
def test_policy_in_a_fresh_process(env, mode, threads, wait, policies):
    assert _result(policies[json.dumps(env)]) == {"mode": mode, "threads": threads, "wait": wait}


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores to narrow the affinity")
def test_thread_count_follows_the_affinity_set_after_start(policies):
    got = _result(policies["affinity"])
    assert got["mode"] == "auto" and got["threads"] == 1


def test_a_process_driving_a_gpu_runs_torch_on_one_cpu_thread_unless_the_user_fixed_it(policies):
    """Its CPU ops are small index lists, where OpenMP regions cost thread wake-ups (k3.cpu_threads)."""
    assert _result(policies["accelerator"]) == {"first": len(CPUS), "mode": "auto", "threads": 1}
    assert _result(policies["accelerator fixed"]) == {"first": 2, "mode": "fixed", "threads": 2}


def test_a_thread_count_set_by_the_caller_is_kept(policies):
    n = CALLER_THREADS
    want = {"mode": "caller", "threads": n, "wait": [None, "10000"], "governed": [False, n]}
    assert _result(policies["caller"]) == want


BUSY = """
import subprocess
hog = subprocess.Popen([sys.executable, "-c",  # spins on our last core until killed or orphaned
                        "import os\\nos.sched_setaffinity(0, {%d})\\nwhile os.getppid() == %d: pass"
                        % (max(os.sched_getaffinity(0)), os.getpid())])
try:
    governor = cpu_threads.ThreadGovernor()
    governor.update()
    time.sleep(1.5)
    result = {"available": governor.policy.available, "threads": governor.update(),
              "torch": torch.get_num_threads(), "foreign": governor.last_foreign}
finally:
    hog.kill()
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs a core for the busy process beside one of ours")
def test_governor_gives_a_core_back_to_a_busy_process_on_it():
    got = _fresh_process(BUSY, cpus=set(CPUS[:2]))
    assert got["available"] == 2
    assert got["foreign"] >= 0.5, got  # the busy process had the core at least half of the time
    assert got["threads"] == got["torch"] == 1, got


SPIN = """
torch.set_num_threads(2)
x = torch.ones(1 << 18)
x.mul_(1.0)  # starts the worker thread
def other_threads_cpu():  # seconds of CPU of every thread but the main one
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
start = other_threads_cpu()
for _ in range(100):
    x.mul_(1.0)  # one short parallel region ...
    time.sleep(0.01)  # ... then a gap in which the worker waits for the next one
result = {"worker_cpu": other_threads_cpu() - start}
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores for two OpenMP threads")
def test_import_k3_stops_openmp_workers_spinning_through_gaps_between_parallel_regions():
    """The real libgomp, loaded by torch after `import k3`: its waiting worker spins briefly, then sleeps,
    instead of burning the 10 ms gaps (libgomp's own default spins up to ~10 ms; ACTIVE spins for ever)."""
    k3_default = _fresh_process(SPIN, cpus=set(CPUS[:2]))["worker_cpu"]
    spinning = _fresh_process(SPIN, {"OMP_WAIT_POLICY": "ACTIVE"}, cpus=set(CPUS[:2]))["worker_cpu"]
    assert spinning > 0.15, spinning  # the gaps add up to 1 s, which a spinning worker burns when it can
    assert k3_default < spinning / 3, (k3_default, spinning)


def test_poll_measures_at_most_once_per_interval(monkeypatch):
    """The trainer polls between layers; a poll inside the interval measures nothing, one after it re-chooses."""
    from k3 import cpu_threads
    governor = object.__new__(cpu_threads.ThreadGovernor)  # no policy applied to this test process's torch
    governor.threads, governor._last = 2, LoadSample(100.0, 0.0, 0, 0)
    calls = []
    monkeypatch.setattr(governor, "update", lambda: calls.append(1) or 1)
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: 100.3)
    governor.poll(min_interval=0.5)
    assert calls == [] and governor.poll(min_interval=0.5) == 2
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: 100.6)
    assert governor.poll(min_interval=0.5) == 1 and calls == [1]


def test_trainer_layers_poll_the_governor(tmp_path, monkeypatch, short_corpus):
    """A step re-chooses its threads inside the forward (a hook per decoder layer), not only between steps."""
    from k3.train.trainer import TrainConfig, Trainer
    trainer = Trainer(TrainConfig(out=str(tmp_path / "run"), corpus=short_corpus, max_steps=1, seq_len=32,
                                  batch_size=2),
                      log=lambda *a: None)
    polls = []
    monkeypatch.setattr(trainer.cpu_threads, "poll", lambda: polls.append(1) or 1)  # returns a count, as poll does
    trainer.train_step()
    assert len(polls) >= len(trainer.model.model.layers)
