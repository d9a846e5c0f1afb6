"""One KDA layer's decode step of `small` on one GPU, bf16: the one-kernel step (k3.ops._kda_decode_triton,
"ours") against the unfused step (three conv kernels, the gate's GEMM, fla's recurrent kernel, tail copies, fla's
gated norm: "peer"), both between the same fused input projection and o_proj, over a StaticCache.

Timed in a CUDA graph that replays the layer 12 times (small's KDA layers in a step), so launch gaps count as
they do in the graphed decode; kernels per layer counted by torch.profiler on one eager call. Floor = the bytes a
step must move (the layer's weights once, each row's fp32 state and conv tails read and written) / the copy
bandwidth measured in the run. Run: PYTHONPATH=src python benchmarks/bench_gpu_kda_decode.py [--batches 1,8,64]
"""
import argparse
import os
import sys

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import measure_ceilings, save, table, time_ms  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.model.kda import KimiDeltaAttention  # noqa: E402
from k3.ops.fused_linear import fuse_projections  # noqa: E402
from k3.ops.kda_decode import force_fused_decode  # noqa: E402

CALLS = 12  # layer calls per graph replay


def floor_bytes(attn: KimiDeltaAttention, batch: int) -> int:
    H, K, W = attn.num_heads, attn.head_dim, attn.q_conv1d.weight.shape[-1]
    weights = sum(p.numel() * p.element_size() for p in attn.parameters())
    per_row = (H * K * K + 3 * (W - 1) * H * K) * 4 * 2  # state and tails, read and written
    return weights + batch * per_row


def kernels_per_call(step) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def graphed(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: Triton compiles, cuBLAS workspaces
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_kda_decode: needs CUDA")
    ceil = measure_ceilings()
    copy_bw = ceil["copy_TBps"] * 1e12
    print(ceil, flush=True)
    cfg = K3Config.preset("small")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    fuse_projections(model)
    attn = next(layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, KimiDeltaAttention))
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        x = torch.randn(B, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        floor_us = floor_bytes(attn, B) / copy_bw * 1e6
        for path, fused in (("ours: one kernel", True), ("peer: unfused", False)):
            cache = model.new_cache(B, 16)
            with force_fused_decode(fused), torch.no_grad():
                kernels = kernels_per_call(lambda: attn(x, cache=cache))
                graph = graphed(lambda: [attn(x, cache=cache) for _ in range(CALLS)])
                us = time_ms(graph.replay, warmup=3, reps=20) * 1e3 / CALLS
            rows.append(dict(batch=B, path=path, kernels=kernels, us_per_layer=us, floor_us=floor_us,
                             roofline_frac=floor_us / us))
            print(rows[-1], flush=True)
            del graph, cache
            torch.cuda.empty_cache()
    print(table(rows, ["batch", "path", "kernels", "us_per_layer", "floor_us", "roofline_frac"]))
    save("kda_decode", {"rows": rows, "ceilings": ceil})


if __name__ == "__main__":
    main()
