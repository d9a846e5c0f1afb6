"""Cost of vLLM's sampling parameters and of prompt logprobs in k3's batched sampler, at K3's vocabulary.

Per decode step we time the whole `sample_tokens` call over S rows of [S, 163840] logits:
  greedy / random    no parameters (the peer: what a step costs without them; random: temperature 0.8, top-p 0.9),
  all params         every row with logit_bias (1,024 entries), presence/frequency/repetition penalties over a
                     4,096-token prompt and 2,048 generated tokens, min_tokens banning 1,024 stop ids, min_p,
                     temperature and top-p,
  half params        the same on every other row (the rest plain): rows without parameters pay nothing extra,
  adjust             `adjust_logits` + `record_tokens` alone on the all-params rows: what the new parameters add
                     before sampling (min_p, inside sample_rows, changes the sort's input and is in the columns).
Prompt logprobs: `score_rows` over a 2,048-token prefill chunk's logits (log-softmax in float32, the target's
logprob, top-20), in the runner's 256-row slices. The hardware limit is measured, not assumed: one clone of
the same tensor (a read and a write of every logit), the least any pass over the logits costs.
Run: OMP_NUM_THREADS=1 python benchmarks/bench_sampling_params.py [--rows 1,64] [--repeats 20] [--device cuda]
"""
import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import commit  # noqa: E402

from k3.serve.runner import SCORE_ROWS
from k3.serve.sampling import (SamplingParams, adjust_logits, make_adjuster, record_tokens, sample_tokens,
                               score_rows)

VOCAB = 163840


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of fn() over repeats (after one warm-up), synchronised on CUDA."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def loaded_params(gen: torch.Generator) -> SamplingParams:
    bias = dict(zip(torch.randint(0, VOCAB, (1024,), generator=gen).tolist(),
                    (torch.rand(1024, generator=gen) * 20 - 10).tolist()))
    return SamplingParams(max_tokens=4096, temperature=0.8, top_p=0.9, min_p=0.05, logit_bias=bias,
                          presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=4000,
                          stop_token_ids=torch.randint(0, VOCAB, (1024,), generator=gen).tolist())


def step_setup(rows: int, which: str, device: torch.device, gen: torch.Generator):
    """(params, generators, adjusters, banning) for one step of `rows` rows."""
    params, adjusters = [], []
    for r in range(rows):
        loaded = which == "all params" or (which == "half params" and r % 2 == 0)
        if loaded:
            p = loaded_params(gen)
            a = make_adjuster(p, torch.randint(0, VOCAB, (4096,), generator=gen).tolist(), {VOCAB - 1})
            a.materialize(VOCAB, device)
            out = torch.randint(0, VOCAB, (2048,), generator=gen).to(device)
            a.counts = torch.bincount(out, minlength=VOCAB).float()  # a 2,048-token output so far
        else:
            p, a = SamplingParams(max_tokens=4096, temperature=0.0 if which == "greedy" else 0.8, top_p=0.9), None
        params.append(p)
        adjusters.append(a)
    gens = [torch.Generator().manual_seed(r) for r in range(rows)]
    return params, gens, adjusters, [a is not None for a in adjusters]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}, torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit()}, "
          f"vocab {VOCAB}, medians of {args.repeats}, ms")
    print("| rows | greedy | random | all params | half params | adjust | one S×V clone (limit) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = torch.randn(rows, VOCAB, generator=gen).to(device)
        ms = {}
        for which in ("greedy", "random", "all params", "half params"):
            params, gens, adjusters, banning = step_setup(rows, which, device, gen)
            # the counts stay as set up: the penalties' per-step scatter is timed, the counts' growth is not
            saved = [a.counts if a is not None else None for a in adjusters]

            def step():
                sample_tokens(logits, params, gens, None, adjusters, banning)
                for a, c in zip(adjusters, saved):
                    if a is not None:
                        a.counts = c
            ms[which] = timed(step, args.repeats, device)
            if which == "all params":
                picked = torch.randint(0, VOCAB, (rows,), generator=gen).to(device)

                def adjust():
                    adjust_logits(logits, params, adjusters, banning)
                    record_tokens(adjusters, picked)
                    for a, c in zip(adjusters, saved):
                        a.counts = c
                ms["adjust"] = timed(adjust, args.repeats, device)
        limit = timed(lambda: logits.clone(), args.repeats, device)
        print(f"| {rows} | {ms['greedy']:.3f} | {ms['random']:.3f} | {ms['all params']:.3f} | "
              f"{ms['half params']:.3f} | {ms['adjust']:.3f} | {limit:.3f} |")
    chunk = 2048
    logits = torch.randn(chunk, VOCAB, generator=gen).to(device)
    targets = torch.randint(0, VOCAB, (chunk,), generator=gen).to(device)

    def score():
        for a in range(0, chunk, SCORE_ROWS):
            score_rows(logits[a:a + SCORE_ROWS], targets[a:a + SCORE_ROWS], 20)
    ms = timed(score, max(3, args.repeats // 4), device)
    limit = timed(lambda: logits.clone(), max(3, args.repeats // 4), device)
    print(f"\nprompt logprobs of a {chunk}-token chunk (top-20, {SCORE_ROWS}-row slices): {ms:.2f} ms; "
          f"one clone of its logits (limit): {limit:.2f} ms")


if __name__ == "__main__":
    main()
