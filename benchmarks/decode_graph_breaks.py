"""Graph breaks of the compiled decode steps: what torch.compile splits them at, with each break's source line.

The two decode steps a GPU compiles or captures: GraphedDecodeStep's `model.model(tokens, cache)` over a StaticCache
(bench_gpu_decode --compile) and the serving engine's fixed-shape step (`DecodeGraphs._forward` over the paged pool).
Each is run once through `torch._dynamo.explain` after a real prefill; prints the number of graphs and every break.
Zero breaks and one graph is the goal (tests/test_decode_compile_graph.py asserts it for `tiny` on the CPU; this
script looks at the paths only a GPU takes: fla's KDA kernels, bf16 grouped GEMMs, the kernels of K3_TRITON).
Run: PYTHONPATH=src python benchmarks/decode_graph_breaks.py [--preset small] [--batch 1,64] [--device cuda]
"""
import argparse
import json

import torch
import torch._dynamo as dynamo

from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM
from k3.ops.fused_linear import fuse_projections
from k3.serve import EngineConfig, LLMEngine, SamplingParams


def explained(step, *args, **kwargs) -> dict:
    """Graphs and breaks (innermost source line, first line of the reason) of one traced call of step (also
    train_graph_breaks')."""
    dynamo.reset()
    ex = dynamo.explain(step)(*args, **kwargs)
    breaks = []
    for b in ex.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f"{frame.filename.split('/src/')[-1]}:{frame.lineno}" if frame else "?"
        breaks.append(f"{where}: {b.reason.splitlines()[0][:160]}")
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": sorted(set(breaks))}


def static_step(model, batch: int) -> dict:
    cfg = model.config
    cache = model.new_cache(batch, 40)
    model(torch.randint(0, cfg.vocab_size, (batch, 16), device=model.device), cache=cache)
    fuse_projections(model)
    tokens = torch.randint(0, cfg.vocab_size, (batch, 1), device=model.device)
    return explained(lambda t: model.model(t, cache=cache), tokens)


def engine_step(model, batch: int) -> dict:
    memory = (8 << 30) if model.device.type == "cuda" else (64 << 20)  # small's KDA states: 9.4 MB a sequence
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=memory, block_size=16, match_unit=16, max_batch_tokens=4096,
                                              max_num_seqs=max(batch, 2), decode_graphs=True))
    graphs, found = eng.runner.graphs, {}
    graphs.capture = False  # the fixed-shape step run eagerly (explain runs it once more: the tokens may differ)

    def forward(view, _real=graphs._forward):
        if not found:
            found.update(explained(_real, view))
        return _real(view)
    graphs._forward = forward
    eng.generate([[5 + i] * 16 for i in range(batch)], SamplingParams(max_tokens=2, temperature=0.0))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", default="1,64", help="comma-separated decode batch sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU by default")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    torch.manual_seed(0)
    with torch.device(a.device):
        model = K3ForCausalLM(K3Config.preset(a.preset)).to(dtype).eval()
    with torch.no_grad():
        for batch in (int(b) for b in a.batch.split(",")):
            for name, probe in (("static", static_step), ("engine", engine_step)):
                print(json.dumps({"preset": a.preset, "batch": batch, "step": name, **probe(model, batch)}), flush=True)


if __name__ == "__main__":
    main()
