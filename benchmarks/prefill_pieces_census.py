"""What the host still launches in an engine step once its pieces are graphs (k3.serve.prefill_graphs): counts of
torch ops that launch a kernel on a GPU (views, allocations and host-only ops left out), in one prefill step of
`--seqs` prompts of `--input-len` tokens, through the plain eager step and through the pieces. Counts, not times,
on the CPU: `small`'s layer pattern (16 layers, 12 KDA + 4 MLA, dense layer 0, 64 experts top-8) at tiny widths,
since a count does not depend on widths. KDA's core is counted apart as calls: on a GPU each is fla's chunk_kda
(9 Triton kernels + 3 fills), on a CPU the torch reference (many more ops). On a GPU the plain step's norms, mixes
and SiTU are one Triton kernel each where the CPU counts their torch ops, so its total here is an upper bound.

    OMP_NUM_THREADS=1 python benchmarks/prefill_pieces_census.py [--seqs 8 --input-len 256]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import k3.model.kda as kda_model
from k3 import K3ForCausalLM
from k3.config import _scaled
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from k3.serve import prefill_graphs as pg

sys.path.insert(0, os.path.dirname(__file__))
from op_census import launches_kernel  # noqa: E402

class Census(TorchDispatchMode):
    """Kernel-launching ops by where they run: `where` is set by the wrappers below."""

    def __init__(self):
        super().__init__()
        self.counts, self.where = collections.Counter(), "outside"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if launches_kernel(func, args, out):
            self.counts[self.where] += 1
        return out


@contextlib.contextmanager
def labelled(census: Census, label: str):
    before, census.where = census.where, label
    try:
        yield
    finally:
        census.where = before


def one_step(model, pieces: bool, seqs: int, input_len: int) -> tuple[collections.Counter, int, int]:
    """(ops by label, KDA core calls, breaks) of the engine's first step (every prompt's first chunk)."""
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=256 << 20, block_size=256, match_unit=16,
                                              max_batch_tokens=seqs * input_len, max_num_seqs=seqs,
                                              decode_graphs=True, prefill_graphs=pieces))
    g = torch.Generator().manual_seed(0)
    for _ in range(seqs):
        eng.add_request(torch.randint(64, model.config.vocab_size, (input_len,), generator=g).tolist(),
                        SamplingParams(max_tokens=1, temperature=0.0))
    census, calls = Census(), collections.Counter()
    core, split = kda_model.kda_core, pg.PrefillGraph.split

    def counted_core(*a, **k):
        calls["core"] += 1
        with labelled(census, "kda core"):
            return core(*a, **k)

    def counted_split(self, fn, *a):
        kind = "break kda" if fn.func.__name__ == "_kda_core" else "break mla"

        def run(*inputs):
            calls["break"] += 1
            with labelled(census, kind):
                fn(*inputs)
        return split(self, run, *a)
    forward = model.model.forward

    def counted_forward(*a, **k):
        with labelled(census, "model"):
            return forward(*a, **k)
    kda_model.kda_core, pg.PrefillGraph.split, model.model.forward = counted_core, counted_split, counted_forward
    try:
        with census:
            eng.step()
    finally:
        kda_model.kda_core, pg.PrefillGraph.split = core, split
        del model.model.forward
    return census.counts, calls["core"], calls["break"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = _scaled(num_layers=16, hidden=128, heads=4, head_dim=32, vocab=8192, dense_inter=384, experts=64,
                  topk=8, expert_inter=64, q_lora=64, kv_lora=32, rope=16, block=4)
    model = K3ForCausalLM(cfg).eval()
    print(f"one prefill step: {a.seqs} prompts x {a.input_len} tokens = {a.seqs * a.input_len} tokens, "
          f"{cfg.num_hidden_layers} layers ({sum(map(cfg.is_mla, range(cfg.num_hidden_layers)))} MLA)\n")
    print("| step | model ops launched eagerly (KDA cores apart) | KDA core calls | graph replays | in graphs | "
          "runner + sampler ops |")
    print("|---|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        plain, plain_cores, _ = one_step(model, False, a.seqs, a.input_len)
        piece, piece_cores, breaks = one_step(model, True, a.seqs, a.input_len)
    print(f"| plain eager step | {plain['model']:,} | {plain_cores} | 0 | 0 | {plain['outside']:,} |")
    # through the pieces on a GPU the breaks run eagerly between graph replays, the rest of the model in them
    kda, mla = piece["break kda"], piece["break mla"]
    print(f"| through the pieces | {kda + mla:,} (KDA {kda:,}, MLA {mla:,}) | {piece_cores} | {breaks + 1} | "
          f"{piece['model']:,} | {piece['outside']:,} |")
    print(f"\n(KDA's reference cores on this CPU: {plain['kda core']:,} and {piece['kda core']:,} ops)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
