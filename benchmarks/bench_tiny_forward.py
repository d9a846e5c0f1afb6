"""Tokens per second of the tiny preset on CPU in float32: inference forward and a training step
(forward + backward). Prints a markdown table.

    python benchmarks/bench_tiny_forward.py [--batch 8] [--seq 256] [--warmup 2] [--iters 5] [--threads N]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from k3 import K3Config, K3ForCausalLM


def median_seconds(fn, warmup: int, iters: int) -> tuple[float, list[float]]:
    """Runs fn `warmup` times untimed (allocator, first-call dispatch), then `iters` timed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = K3Config.preset(args.preset)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    tokens = args.batch * args.seq

    model.eval()

    def forward():
        with torch.no_grad():
            model(ids)

    fwd, fwd_all = median_seconds(forward, args.warmup, args.iters)

    model.train()

    def train_step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=labels).loss.backward()

    step, step_all = median_seconds(train_step, args.warmup, args.iters)

    print(f"k3 `{args.preset}` preset ({n_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, "
          f"hidden {config.hidden_size}, {config.num_experts} experts top-{config.num_experts_per_token}), "
          f"CPU float32, batch {args.batch} × seq {args.seq} = {tokens} tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.processor() or platform.machine()}; "
          f"median of {args.iters} after {args.warmup} warm-up\n")
    print("| mode | median s / iter | min s | max s | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for name, med, all_t in (("forward (eval, no_grad)", fwd, fwd_all), ("train step (forward + backward)", step, step_all)):
        print(f"| {name} | {med:.3f} | {min(all_t):.3f} | {max(all_t):.3f} | {tokens / med:,.0f} |")


if __name__ == "__main__":
    main()
