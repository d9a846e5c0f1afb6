"""Cost of constrained decoding per decode step: the grammar mask in the batched sampler, at 1 and 32 streams.

Every stream follows a grammar (a JSON schema, or a forced tool call in K3's markup) and walks through it as a
random model would: each step samples from random logits within the mask. Per step we time
  fill     llguidance computing the allowed-token bitmasks of all constrained rows (its thread pool, in parallel),
  sampler  the whole `sample_tokens` call with grammars (fill + unpack + mask + sample + advance the matchers),
  plain    the same `sample_tokens` call without grammars (the peer: what an unconstrained step costs),
so "sampler − plain" is what constraining adds to a step. The hardware limit of the mask itself is a memory pass
over the logits (S × V floats), far below these figures; what dominates is the grammar engine's work per row.
A row whose grammar completes starts again, so every step has every row constrained.
Run: OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py [--streams 1,32] [--steps 200] [--tokenizer DIR]
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

from k3.data import load_tokenizer
from k3.serve.grammar import Grammar, chat_grammar, fill_bitmasks
from k3.serve.sampling import SamplingParams, sample_tokens

ORDER = {"type": "object", "additionalProperties": False, "required": ["kind", "items", "urgent", "note"],
         "properties": {"kind": {"enum": ["buy", "sell"]}, "urgent": {"type": "boolean"},
                        "note": {"type": "string", "maxLength": 40},
                        "items": {"type": "array", "maxItems": 4, "items": {
                            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "maxLength": 8},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 999}}}}}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}, "note": {"type": "string", "maxLength": 20}}}}}
    for name in ("add", "subtract", "multiply", "divide")]
GRAMMARS = {
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}),
    "tool call": dict(tools=TOOLS, tool_choice="required"),
}


def run(tok, grammar: Grammar, streams: int, steps: int, seed: int = 0) -> dict:
    V = tok.vocab_size
    gen = torch.Generator().manual_seed(seed)
    states = [grammar.start() for _ in range(streams)]
    params = [SamplingParams(max_tokens=10**6, temperature=1.0) for _ in range(streams)]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(streams)]
    fill, sampler, plain = [], [], []
    words = torch.zeros(streams, (V + 31) // 32, dtype=torch.int32)
    for step in range(steps):
        logits = torch.randn(streams, V, generator=gen)
        t0 = time.perf_counter()
        fill_bitmasks(states, words)
        t1 = time.perf_counter()
        sample_tokens(logits, params, gens)
        t2 = time.perf_counter()
        sample_tokens(logits, params, gens, states)
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        plain.append(t2 - t1)
        sampler.append(t3 - t2)
        for i, s in enumerate(states):
            if s.matcher.is_stopped() or s.matcher.is_accepting():
                states[i] = grammar.start()
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"fill": ms(fill), "sampler": ms(sampler), "plain": ms(plain), "added": ms(sampler) - ms(plain)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json or the released tiktoken files' directory")
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    import llguidance
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"llguidance {llguidance.__version__}, vocab {tok.vocab_size}, commit {commit()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| grammar | streams | llguidance fill, ms | sample_tokens with grammar, ms | without (peer), ms | "
          "added per step, ms | added per row, µs |")
    print("|---|---|---|---|---|---|---|")
    for name, kw in GRAMMARS.items():
        grammar = Grammar(tok, chat_grammar(tok, thinking=False, **kw))
        for s in (int(x) for x in args.streams.split(",")):
            r = run(tok, grammar, s, args.steps)
            print(f"| {name} | {s} | {r['fill']:.3f} | {r['sampler']:.3f} | {r['plain']:.3f} | {r['added']:.3f} | "
                  f"{r['added'] / s * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
