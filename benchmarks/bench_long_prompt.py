"""Peak memory and time of `generate` on a long prompt, CPU float32: the default memory-bounded ("auto") chunked
prefill against one pass. Each case runs in its own process (peak RSS is per process); prints a markdown table.

    python benchmarks/bench_long_prompt.py [--preset tiny] [--lengths 2048,4096,15600] [--one-pass-max 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def one_case(preset: str, T: int, chunk: str) -> dict:
    import torch

    from k3 import K3Config, K3ForCausalLM
    from k3.model.generate import prefill_chunk_sizes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset)).eval()
    ids = torch.randint(3, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    chunks = (len(prefill_chunk_sizes(model.config, 1, T, model.device, model.dtype)) if chunk == "auto" else 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, eos_token_id=None, prefill_chunk="auto" if chunk == "auto" else None)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"tokens": T, "prefill": chunk, "chunks": chunks, "seconds": seconds,
            "peak_mib": peak / 1024, "over_model_mib": (peak - before) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--lengths", default="2048,4096,15600")
    ap.add_argument("--one-pass-max", type=int, default=4096, help="longest prompt also run in one pass")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: T,mode in a child process
    a = ap.parse_args()
    if a.case:
        T, mode = a.case.split(",")
        print(json.dumps(one_case(a.preset, int(T), mode)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, preset {a.preset}, float32, "
          f"1 thread, max_new_tokens=1\n")
    print("| prompt tokens | prefill | chunks | seconds | peak RSS MiB | above the built model MiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for T in (int(x) for x in a.lengths.split(",")):
        for mode in (["auto", "one pass"] if T <= a.one_pass_max else ["auto"]):
            out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--case", f"{T},{mode}"],
                                 env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {T:,} | {mode} | {r['chunks']} | {r['seconds']:.1f} | {r['peak_mib']:,.0f} | "
                  f"{r['over_model_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
