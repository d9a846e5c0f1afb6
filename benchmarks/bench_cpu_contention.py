"""The `tiny` training step (k3 train's defaults: batch 16 x 256) on CPU, idle and beside one busy process pinned to
one of its cores, under each thread setting: torch's defaults as they were before k3 chose its threads, the
README's old `OMP_NUM_THREADS=1` advice, k3 at a fixed 1 and at all cores, k3's default (adapting), and k3's
default with libgomp's own spin-wait or with none (the choice of `k3.cpu_threads.SPIN_COUNT`).

    python benchmarks/bench_cpu_contention.py [--rounds 3] [--steps 4] [--block-seconds 60] [--json out.json]

Each setting runs in its own process (OpenMP reads its environment once, at load), alternating blocks of
`--steps` steps idle and beside the busy process `--rounds` times, so drifting background load hits both
columns alike. A step's time is measured around `Trainer.train_step`, so it includes k3's thread choice. The
busy process is a Python loop pinned to the last core this process may use, in a session of its own (another
program's autogroup); it is stopped after each block, on Ctrl-C or SIGTERM, and by itself once the process that
started it is gone.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKENS_PER_STEP = 16 * 256  # TrainConfig's batch_size x seq_len, the main job's step

SETTINGS = [  # (name, environment); the worker's environment starts clean of every threading variable
    ("before: torch defaults (all cores, OpenMP spin-wait)", {"K3_CPU_THREADS": "off"}),
    ("before: OMP_NUM_THREADS=1 (the README's advice)", {"K3_CPU_THREADS": "off", "OMP_NUM_THREADS": "1"}),
    ("k3, fixed 1 thread", {"K3_CPU_THREADS": "1"}),
    ("k3, fixed all cores", {"K3_CPU_THREADS": "ALL"}),
    ("**k3 default** (adapts to load; OpenMP spins 10,000 turns)", {}),
    ("k3 default, but libgomp's own spin (300,000 turns)", {"GOMP_SPINCOUNT": "300000"}),
    ("k3 default, but OMP_WAIT_POLICY=PASSIVE (no spin)", {"OMP_WAIT_POLICY": "PASSIVE"}),
]
THREAD_VARIABLES = ("K3_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# The busy process: spins on one core; checks ten times a second that its parent still lives.
HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
parent = int(sys.argv[2])
while os.getppid() == parent:
    end = time.monotonic() + 0.1
    while time.monotonic() < end:
        pass
"""


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop the busy process and the workers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class BusyProcess:
    """A busy loop pinned to one core while the `with` block runs."""

    def __init__(self, cpu: int):
        self.cpu = cpu

    def __enter__(self):
        # its own session, as another program would be: with the scheduler's autogroups a process in ours
        # would share our group's CPU time instead of competing as a separate job
        self.proc = subprocess.Popen([sys.executable, "-c", HOG, str(self.cpu), str(os.getpid())],
                                     start_new_session=True)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def worker(args) -> None:
    """Runs in one setting's process: warm-up, then alternating idle / busy blocks; prints JSON."""
    import torch

    from k3.train.trainer import TrainConfig, Trainer

    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(TrainConfig(out=str(Path(tmp) / "run"), device="cpu"), log=lambda *a, **k: None)
        for _ in range(args.warmup):
            trainer.train_step()
        steps = {"idle": [], "busy": []}
        threads = {"idle": [], "busy": []}
        for _ in range(args.rounds):
            for load in ("idle", "busy"):
                hog = BusyProcess(cpus[-1]) if load == "busy" else None
                if hog:
                    hog.__enter__()
                try:
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        trainer.train_step()
                        steps[load].append(time.perf_counter() - t0)
                        threads[load].append(torch.get_num_threads())
                        if time.perf_counter() - start > args.block_seconds:
                            break
                finally:
                    if hog:
                        hog.__exit__()
    print(json.dumps({"steps": steps, "threads": threads, "wait": [os.environ.get(v) for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]}))


def run_setting(env_overrides: dict, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    ncpu = len(os.sched_getaffinity(0))
    env.update({k: (str(ncpu) if v == "ALL" else v) for k, v in env_overrides.items()})
    cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--block-seconds", str(args.block_seconds)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.terminate()  # the worker's SIGTERM handler stops its busy process
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}) for {env_overrides}")
    return json.loads(out.strip().splitlines()[-1])


def _commit() -> str:
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="idle/busy block pairs per setting")
    ap.add_argument("--steps", type=int, default=4, help="steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--block-seconds", type=float, default=60.0, help="a block ends after this long (>= 1 step)")
    ap.add_argument("--only", type=int, nargs="*", help="run only these settings (0-based rows of the table)")
    ap.add_argument("--json", help="also write the step times here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _exit_on_sigterm()
    if args.worker:
        worker(args)
        return

    import torch

    ncpu = len(os.sched_getaffinity(0))
    load = os.getloadavg()
    print(f"`tiny` training step, batch 16 x 256 = {TOKENS_PER_STEP} tokens, float32; {ncpu} cores in this "
          f"process's affinity ({_cpu_name()}), busy process pinned to core {sorted(os.sched_getaffinity(0))[-1]}; "
          f"torch {torch.__version__}, kernel {platform.release()}, commit {_commit()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average before {load[0]:.1f}; "
          f"median over {args.rounds} x {args.steps} steps per column, after {args.warmup} warm-up\n", flush=True)
    print("| threads setting | threads idle / busy | tokens/s idle | tokens/s beside a busy process | "
          "median step s idle / busy | busy ÷ idle |")
    print("|---|---|---:|---:|---:|---:|", flush=True)
    raw = {}
    for i, (name, env) in enumerate(SETTINGS):
        if args.only is not None and i not in args.only:
            continue
        r = raw[name] = run_setting(env, args)
        idle, busy = statistics.median(r["steps"]["idle"]), statistics.median(r["steps"]["busy"])
        th = {k: "/".join(str(t) for t in sorted(set(v))) for k, v in r["threads"].items()}
        print(f"| {name} | {th['idle']} / {th['busy']} | {TOKENS_PER_STEP / idle:,.0f} | "
              f"{TOKENS_PER_STEP / busy:,.0f} | {idle:.2f} / {busy:.2f} | **{busy / idle:.1f}x** |", flush=True)
        print(f"    step seconds: {json.dumps(r['steps'])}", file=sys.stderr, flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
