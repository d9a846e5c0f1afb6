"""Hardware counters of one graphed decode step of `small` (bf16, one GPU), kernel by kernel, from Nsight Compute.

The event timings (bench_gpu_decode.py) say how far a step is from its byte floor; the torch profiler says which
kernels take the time. Neither says why a kernel moves its bytes at half the card's bandwidth: too few warps
resident (registers, shared memory), warps waiting on memory with too few loads in flight, a tail of idle SMs, or
instruction overhead. ncu reads that from the card's counters: per kernel node of the captured step (each replayed
alone, caches flushed first, clocks left alone), its duration, DRAM bytes and throughput, achieved and theoretical
occupancy and what limits it, and where its warps stall.

Run (on the GPU machine; ncu must be on the PATH or named by --ncu):
    PYTHONPATH=src python benchmarks/ncu_decode.py --batches 64 [--context 4096] [--out DIR] [--launch MODULE:k=v]
which runs this file's `--child` under ncu once a batch, keeps the report (DIR/ncu_b64.ncu-rep) and its raw CSV,
and prints the table; `--report DIR/ncu_b64.csv` prints the table of a CSV again (on any machine).
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
# ncu's units (decimal) → µs, MB and GB/s
_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6,
          "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
          "byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}
TIME, DRAM_RATE, DRAM_PCT = ("gpu__time_duration.sum", "dram__bytes.sum.per_second",
                             "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def child(batch: int, context: int, launches: list[str]) -> None:
    """One graphed decode step of `small` at this batch and context inside cudaProfilerStart/Stop (what ncu,
    started with --profile-from-start off, profiles), after warm steps that compile and tune every kernel; the
    graph captured with the `launches` changes (MODULE:k=v, as bench_gpu_decode.py's --launch)."""
    import contextlib

    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_gpu_decode import filled_cache
    from gpu_bench_util import changed_launch, parse_launch

    from k3.config import K3Config
    from k3.model.cuda_graph import GraphedDecodeStep
    from k3.model.decoder import K3ForCausalLM

    cfg = K3Config.preset("small")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
    with torch.no_grad(), contextlib.ExitStack() as changes:
        for spec in launches:
            changes.enter_context(changed_launch(*parse_launch(spec)))
        graphed = GraphedDecodeStep(model, filled_cache(model, cfg, batch, context))
        for _ in range(3):
            graphed.step(tok)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        graphed.step(tok)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def _number(text: str, unit: str) -> float | None:
    try:
        v = float(text.replace(",", ""))
    except ValueError:
        return None
    return v * _SCALE.get(unit, 1.0)


def read_raw(path: str) -> list[dict]:
    """ncu's raw page as CSV (a header of metric names, a row of units, a row a kernel) → one dict a kernel:
    times in µs, bytes in MB, rates in GB/s, everything else as ncu gives it (numbers parsed, names kept)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)  # (ncu may print lines first)
    if start is None or start + 1 >= len(rows):
        raise ValueError(f"{path}: no 'Kernel Name' header and units row: not ncu's raw page as CSV")
    names, units = rows[start], rows[start + 1]
    out = []
    for r in rows[start + 2:]:
        if len(r) != len(names):
            continue
        k = {}
        for name, unit, text in zip(names, units, r):
            v = _number(text, unit)
            k[name] = text if v is None else v
        out.append(k)
    return out


def short_name(name: str) -> str:
    """A kernel's name without `void`, its parameters and the namespaces before it, cut at 60 characters (cuBLAS's
    template arguments name its tile, so they stay)."""
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    name = re.sub(r"^void ", "", name.strip())
    head, sep, rest = name.partition("<")
    return (head.split("::")[-1] + sep + rest)[:60]


def table(kernels: list[dict]) -> str:
    """Kernels grouped by short name, the largest total time first: calls, µs each, MB of DRAM each (read +
    written), GB/s achieved, DRAM throughput % of peak, achieved / theoretical occupancy (% of the SM's warps),
    registers a thread, grid × block, and the three largest stall reasons (warp cycles a issued instruction).
    DRAM bytes are the kernel's DRAM rate times its duration (the sections collected give no byte count)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for k in kernels:
        groups[short_name(str(k.get("Kernel Name", "?")))].append(k)

    def mean(ks, metric):
        vals = [k[metric] for k in ks if isinstance(k.get(metric), float)]
        return sum(vals) / len(vals) if vals else float("nan")

    total = sum(mean(ks, TIME) * len(ks) for ks in groups.values())
    lines = [f"{len(kernels)} kernels, {total:.1f} µs of kernel time",
             "| kernel | calls | µs each | share | MB each | GB/s | DRAM % | occupancy ach/theo % | regs "
             "| grid x block | top stalls (cycles/instr) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    order = sorted(groups.items(), key=lambda kv: -mean(kv[1], TIME) * len(kv[1]))
    for name, ks in order:
        us = mean(ks, TIME)
        mb = mean(ks, DRAM_RATE) * us * 1e-3
        stalls = defaultdict(float)
        for k in ks:
            for metric, v in k.items():
                m = STALL.match(metric)
                if m and isinstance(v, float) and not m.group(1).endswith("not_issued"):
                    stalls[m.group(1)] += v / len(ks)
        top = ", ".join(f"{s} {v:.1f}" for s, v in sorted(stalls.items(), key=lambda sv: -sv[1])[:3])
        grid = f"{ks[0].get('launch__grid_size', '?'):.0f} x {ks[0].get('launch__block_size', 0):.0f}" \
            if isinstance(ks[0].get("launch__grid_size"), float) else "?"
        lines.append(f"| {name} | {len(ks)} | {us:.1f} | {us * len(ks) / total:.1%} | {mb:.2f} | "
                     f"{mb / us * 1e3 if us else 0:.0f} | {mean(ks, DRAM_PCT):.0f} | "
                     f"{mean(ks, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.0f} / "
                     f"{mean(ks, 'sm__maximum_warps_per_active_cycle_pct'):.0f} | "
                     f"{mean(ks, 'launch__registers_per_thread'):.0f} | {grid} | {top} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64", help="comma-separated decode batches, one ncu run each")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the reports and CSVs go")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--launch", action="append", default=[], metavar="MODULE:k=v[,k=v]",
                    help="capture the step with a kernel module's LAUNCH entries changed (repeatable)")
    ap.add_argument("--kernels", default="", metavar="REGEX", help="profile only the kernels whose name matches")
    ap.add_argument("--tag", default="", help="appended to the report's name (ncu_b64TAG)")
    ap.add_argument("--report", metavar="CSV", help="only print the table of a raw CSV written before")
    ap.add_argument("--child", type=int, metavar="BATCH", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child, a.context, a.launch)
    if a.report:
        return print(table(read_raw(a.report)))
    os.makedirs(a.out, exist_ok=True)
    for batch in (int(b) for b in a.batches.split(",")):
        rep = os.path.join(a.out, f"ncu_b{batch}{a.tag}")
        cmd = [a.ncu, "--profile-from-start", "off", "--clock-control", "none", "--graph-profiling", "node",
               "-f", "-o", rep, *(f"--section={s}" for s in SECTIONS),
               *(["--kernel-name", f"regex:{a.kernels}"] if a.kernels else []),
               sys.executable, os.path.abspath(__file__), "--child", str(batch), "--context", str(a.context),
               *(f"--launch={spec}" for spec in a.launch)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        with open(rep + ".csv", "w") as f:
            subprocess.run([a.ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw"], stdout=f, check=True)
        print(f"\n## batch {batch}, context {a.context} {' '.join(a.launch)}\n" + table(read_raw(rep + ".csv")),
              flush=True)


if __name__ == "__main__":
    main()
