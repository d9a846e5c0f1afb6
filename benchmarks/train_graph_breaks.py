"""Graph breaks of a compiled training step: where torch.compile splits `tiny`'s training forward, and what each
compiled region of `k3 train --compile` (k3.train.compiled_regions) traces as.

Two views, each through `torch._dynamo.explain` on one training forward (module in training mode, gradients on,
packed documents):
- the whole model's forward (`model(ids, doc_ids=..., labels=...)`) as built: graphs and breaks with their source
  lines, what a compile of the step as one piece would split at (the AttnRes mixes and KDA's eager path);
- each mixer and feed-forward kind alone as compile_regions traces it (fullgraph=True there: one graph and no
  break, or the kind is left eager): graphs and breaks.
Run: PYTHONPATH=src python benchmarks/train_graph_breaks.py [--preset tiny] [--seq 64] [--device cpu] [--dtype float32]
"""
import argparse
import json

import torch

from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM, contiguous_segments
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.model.mlp import SiTUMLP
from k3.model.moe import LatentMoE
from k3.train import compiled_regions

from decode_graph_breaks import explained  # noqa: E402  (benchmarks/ is the script's own directory)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32",
                    help="the model's (bfloat16 on CUDA: the paths that fla and k3's kernels take)")
    a = ap.parse_args()
    torch.manual_seed(0)
    with torch.device(a.device):
        model = K3ForCausalLM(K3Config.preset(a.preset)).to(getattr(torch, a.dtype)).train()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device)
    doc_ids = (torch.rand(a.batch, a.seq, device=a.device) < 0.1).long().cumsum(1)
    step = lambda: model(ids, doc_ids=doc_ids, labels=ids.roll(-1, 1)).loss  # noqa: E731
    report = {"step": explained(step)}
    x = torch.randn(a.batch, a.seq, cfg.hidden_size, device=a.device, dtype=getattr(torch, a.dtype), requires_grad=True)
    segments = contiguous_segments(doc_ids)
    seen = set()
    for layer in model.model.layers:
        for m in (layer.self_attn, getattr(layer, "block_sparse_moe", None), getattr(layer, "mlp", None)):
            if m is None or type(m) in seen:
                continue
            seen.add(type(m))
            traced = getattr(compiled_regions, "_TRACED", {}).get(type(m), type(m).forward)
            if isinstance(m, (KimiDeltaAttention, MultiHeadLatentAttention)):
                report[type(m).__name__] = explained(traced, m, x, doc_ids=segments)
            elif isinstance(m, (LatentMoE, SiTUMLP)):
                report[type(m).__name__] = explained(traced, m, x)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
