"""CPU forward timing of kda_chunk vs kda_recurrent (float32) over sequence length; prints a markdown table.

Run: python benchmarks/bench_kda_cpu.py [--threads N] [--heads 4] [--dim 64]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from k3.ops.kda import kda_chunk, kda_recurrent

LENGTHS = (1024, 2048, 4096, 8192)
RECURRENT_LIMIT_S = 20.0  # skip the recurrent run when the previous length suggests it would pass this


def make_inputs(T, H, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen)
    g = -5.0 * torch.rand(1, T, H, D, generator=gen)  # gates over the whole bounded range (-5, 0)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def best_time_s(fn, budget_s=6.0, max_reps=5):
    """Warm up once, then the fastest of up to max_reps runs within budget_s."""
    fn()
    times, spent = [], 0.0
    while len(times) < max_reps and (not times or spent + times[-1] < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="head dim K = V")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"B=1, H={args.heads}, K=V={args.dim}, float32, forward, chunk_size=64, threads={torch.get_num_threads()}\n")
    print("| T | recurrent ms | chunk ms | speed-up |")
    print("|---:|---:|---:|---:|")
    previous_recurrent = None
    with torch.inference_mode():
        for T in LENGTHS:
            inputs = make_inputs(T, args.heads, args.dim)
            chunk_s = best_time_s(lambda: kda_chunk(*inputs))
            # recurrent cost is linear in T: skip it once doubling the last measured length would pass the limit
            if previous_recurrent is None or previous_recurrent * 2 < RECURRENT_LIMIT_S:
                recurrent_s = best_time_s(lambda: kda_recurrent(*inputs), budget_s=10.0, max_reps=2)
                previous_recurrent = recurrent_s
                row = f"| {T} | {recurrent_s * 1e3:.1f} | {chunk_s * 1e3:.1f} | {recurrent_s / chunk_s:.1f}x |"
            else:
                row = f"| {T} | - | {chunk_s * 1e3:.1f} | - |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
