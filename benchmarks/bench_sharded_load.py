"""Peak host memory of rank-sharded loading (k3.checkpoint.sharded) against a full load, each in a fresh process.

    OMP_NUM_THREADS=1 python benchmarks/bench_sharded_load.py [--preset small] [--ep 4] [--tp 1] [--dir DIR]

Writes a random checkpoint with MXFP4 experts (`k3 init`'s writer) unless DIR holds one, then loads it in a
subprocess per row (bf16, experts packed, on the CPU) and reports: the process's peak RSS (VmHWM) minus its
RSS before loading (after imports), the bytes it keeps (its tensors), the difference (what loading cost beyond
what it keeps: read buffers and mapped file pages), and the largest single tensor read from the files."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, torch
from k3.checkpoint.hf import load_pretrained
from k3.checkpoint.sharded import RankLayout, load_rank_shard
from k3.memory import peak_resident_bytes
path, ep_rank, ep, tp_rank, tp = sys.argv[1], *map(int, sys.argv[2:6])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
if ep == 0:
    stats = {}
    model = load_pretrained(path, dtype=torch.bfloat16, packed_experts=True, stats=stats)
    tensors = list(model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in tensors)
else:
    shard = load_rank_shard(path, RankLayout(ep_rank, ep, tp_rank, tp), dtype=torch.bfloat16, packed_experts=True)
    tensors, largest = list(shard.tensors.values()), shard.stats["largest_read_bytes"]
peak = peak_resident_bytes()
kept = sum(t.numel() * t.element_size() for t in tensors)
print(json.dumps({"before": before, "peak": peak, "kept": kept, "largest": largest}))
"""


def measure(path: Path, ep_rank: int, ep: int, tp_rank: int, tp: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(ep_rank), str(ep), str(tp_rank), str(tp)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="a checkpoint to load (default: write one to a temp dir)")
    ap.add_argument("--shard-size", type=int, default=256 * 2**20)
    a = ap.parse_args()
    from k3 import K3Config
    from k3.checkpoint.random_init import write_random_checkpoint

    tmp = None
    path = a.dir
    if path is None or not (path / "config.json").is_file():
        if path is None:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "ckpt"
        r = write_random_checkpoint(K3Config.preset(a.preset), path, "mxfp4", max_shard_bytes=a.shard_size)
        print(f"wrote {path}: {r['bytes'] / 2**20:,.0f} MiB in {r['shards']} shards")
    mib = lambda n: f"{n / 2**20:,.0f}"
    print(f"| load | peak RSS − before (MiB) | kept tensors (MiB) | beyond kept (MiB) | largest tensor read (MiB) |")
    print("|---|---:|---:|---:|---:|")
    rows = [("full load_pretrained", 0, 0, 0, 1)] + [(f"rank ep {e}/{a.ep}, tp {t}/{a.tp}", e, a.ep, t, a.tp)
                                                      for e in range(a.ep) for t in range(a.tp)]
    for name, *layout in rows:
        m = measure(path, *layout)
        grown = m["peak"] - m["before"]
        print(f"| {name} | {mib(grown)} | {mib(m['kept'])} | {mib(grown - m['kept'])} | {mib(m['largest'])} |",
              flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
