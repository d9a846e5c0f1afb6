"""Shared helpers for the bench_gpu_*.py scripts: event timing, environment stamp, result files."""
from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from k3 import envs

COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on H200 (SPEC §6); re-measured by measure_ceilings()
PEAK_BF16 = 989e12  # dense bf16 datasheet figure the MFU targets use
MATMUL_BF16 = 790e12  # measured 8192^3 bf16 matmul (SPEC §6)


def time_ms(fn, warmup: int = 3, reps: int = 10, inner: int = 1) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events after warmup calls. inner: calls per event
    pair, back to back: the GPU starts idle at each pair's first event, so one call alone also counts its own
    host-side launch (10-40 µs, a visible share of a 0.1 ms kernel)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def cpu_time_ms(fn, warmup: int = 1, reps: int = 3) -> float:
    """Median milliseconds of fn() over reps on the host clock (the CPU's time_ms)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def with_stacks() -> dict:
    """torch.profiler.profile's arguments that record each op's Python stack (for `group_by_stack_n`):
    `with_stack=True` alone records none (pytorch/pytorch#100253), its experimental verbose config is needed too."""
    return dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))


def ops_matching(averages, pattern: str) -> list:
    """The rows of a profiler's `key_averages()` whose op names match the regular expression `pattern`, most GPU
    time first (`ops_table` prints them: torch's own table asserts on a list that holds no kernel events)."""
    return sorted((e for e in averages if re.search(pattern, e.key)), key=lambda e: -e.self_device_time_total)


def ops_table(events: list, reps: int, rows: int) -> str:
    """`ops_matching`'s rows as text: the GPU time of the kernels each op launched, ms a step, its calls a step,
    and what the rows were grouped by (the input shapes, or the launching stack)."""
    lines = ["self GPU ms a step | calls a step | op | shapes / stack"]
    for e in events[:rows]:
        where = str(e.input_shapes) if e.input_shapes else " <- ".join(e.stack or [])
        lines.append(f"{e.self_device_time_total / 1e3 / reps:.3f} | {e.count / reps:g} | {e.key} | {where}")
    total = sum(e.self_device_time_total for e in events) / 1e3 / reps
    lines.append(f"total {total:.3f} ms a step over {len(events)} rows")
    return "\n".join(lines)


def active_params(model, cfg, skip: tuple[str, ...] = ()) -> int:
    """Matmul weights one token uses: every 2-D weight but the embedding (and names containing `skip`), the
    routed experts' at top_k / num_experts."""
    n = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or any(s in name for s in skip):
            continue
        frac = cfg.num_experts_per_token / cfg.num_experts if ".experts.w" in name else 1.0
        n += p.numel() * frac
    return int(n)


def fwd_bwd(fn, inputs: list, params=()):
    """A step for time_ms: fn(leaves) (a tensor or a tuple of them) and its backward into fresh leaves of `inputs`
    and `params`, against fixed random upstream gradients (drawn at the first call)."""
    leaves = [a.detach().requires_grad_() for a in inputs]
    wrt = leaves + list(params)
    grads = None

    def step():
        nonlocal grads
        out = fn(leaves)
        outs = out if isinstance(out, tuple) else (out,)
        if grads is None:
            grads = [torch.randn_like(o) for o in outs]
        torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    return step


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and a bf16 8192^3 matmul rate on this card, now."""
    x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), reps=20)
    bw = 2 * x.numel() * 2 / (ms * 1e-3)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms_mm = time_ms(lambda: a @ b, reps=20)
    del x, y
    return {"copy_TBps": bw / 1e12, "matmul_TFLOPs": 2 * 8192 ** 3 / (ms_mm * 1e-3) / 1e12}


def environment() -> dict:
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    env = {"card": card, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": sys.version.split()[0]}
    for mod in ("triton", "fla"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    env["commit"] = commit()
    return env


def commit() -> str:
    """The measured tree's commit: K3_COMMIT first (a copied tree's .git may not be the one its files came from;
    the device tool's is not), else git's HEAD, else "?"."""
    if envs.current().commit:
        return envs.current().commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except Exception:
        return "?"


def save(name: str, payload: dict) -> None:
    """Write payload as JSON to $OUT/name.json when OUT is set (the device tool brings it back)."""
    out = os.environ.get("OUT")
    payload = {"env": environment(), **payload}
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as fh:
            json.dump(payload, fh, indent=1)
    print(json.dumps(payload["env"]))


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


@contextlib.contextmanager
def changed_launch(launch: dict, change: dict):
    """`launch` (a kernel module's LAUNCH) with `change` applied inside the block, its values put back after."""
    saved = dict(launch)
    launch.update(change)
    try:
        yield
    finally:
        launch.update(saved)


def parse_launch(spec: str) -> tuple[dict, dict]:
    """"MODULE:k=v[,k=v]" (a kernel module of k3.ops, e.g. _moe_expert_major_triton:down_block_l=128) → (its LAUNCH,
    the change); values read as int, then true/false, else kept as text. An unknown module or key is an error."""
    module, _, pairs = spec.partition(":")
    launch = getattr(importlib.import_module(f"k3.ops.{module}"), "LAUNCH", None)
    if launch is None or not pairs:
        raise ValueError(f"--launch {spec!r}: expected MODULE:k=v[,k=v] with MODULE a k3.ops kernel module with LAUNCH")
    change = {}
    for pair in pairs.split(","):
        key, _, value = pair.partition("=")
        if key not in launch:
            raise ValueError(f"--launch {spec!r}: {module}.LAUNCH has no {key!r} (it has {sorted(launch)})")
        change[key] = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value)
    return launch, change
