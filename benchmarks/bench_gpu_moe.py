"""One LatentMoE layer at K3 expert shapes on one GPU (bf16) vs a bare torch._grouped_mm of the same shapes.

K3 shapes: hidden 7168, latent 3584, expert intermediate 3072, top-16, 2 fused shared experts; a subset of
the 896 experts (default 64) so the weights fit and each expert sees a realistic token count.
FLOPs counted for the layer: router 2·N·D·E + latent down/up 2·2·N·D·L + routed experts 2·N·k·3·L·I
+ shared 2·N·3·D·I_shared. The bare figure counts only the three grouped GEMMs (2·N·k·3·L·I) on the
layer's own routing. Target (issue 6): layer TFLOP/s >= 60% of the bare grouped-GEMM TFLOP/s.
Run: PYTHONPATH=src python benchmarks/bench_gpu_moe.py [--quick]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import MATMUL_BF16, fwd_bwd, save, table, time_ms  # noqa: E402

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402


def build(num_experts, quick):
    cfg = K3Config.preset("kimi-k3").replace(num_experts=num_experts, quantization_config=None)
    if quick:
        cfg = cfg.replace(hidden_size=1024, routed_expert_hidden_size=512, moe_intermediate_size=512)
    with torch.device("cuda"):
        moe = LatentMoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return cfg, moe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--experts", type=int, default=64)
    a = ap.parse_args()
    cfg, moe = build(a.experts, a.quick)
    D, L, I, E, k = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                     cfg.num_experts_per_token)
    S_I = cfg.shared_intermediate_size
    rows = []
    for N in ([4096, 16384] if not a.quick else [512]):
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        expert_flops = 2 * N * k * 3 * L * I
        layer_flops = 2 * N * D * E + 2 * 2 * N * D * L + expert_flops + 2 * N * 3 * D * S_I
        # the layer's own routing, for the bare grouped GEMMs
        with torch.no_grad():
            from k3.model.moe import route
            idx, _ = route(moe.router_scores(x), moe.gate.e_score_correction_bias, k)
            counts = torch.bincount(idx.flatten(), minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        z = torch.randn(N * k, L, device="cuda", dtype=torch.bfloat16)
        e = moe.experts

        def bare(zz):
            g = torch._grouped_mm(zz, e.w1.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(zz, e.w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(g * u, e.w2.transpose(-2, -1), offs=offs)  # (product: no activation cost)

        cases = {"bare grouped_mm x3": (bare, z, expert_flops), "LatentMoE layer": (moe, x, layer_flops)}
        for name, (fn, inp, flops) in cases.items():
            for env in ([None] if name.startswith("bare") else [None, "K3_NO_TRITON"]):
                # env: the SiTU kernel off only (the layer's RMSNorm keeps its own kernel)
                with envs.override(no_triton=["_situ_triton"] if env else []):
                    with torch.no_grad():
                        f_ms = time_ms(lambda: fn(inp))
                    params = (moe if fn is moe else e).parameters()
                    fb_ms = time_ms(fwd_bwd(lambda leaves: fn(leaves[0]), [inp], params))
                label = name + (" (reference SiTU)" if env else "")
                rows.append(dict(tokens=N, experts=E, case=label, fwd_ms=f_ms, fwd_TFLOPs=flops / f_ms * 1e-9,
                                 fwd_bwd_ms=fb_ms, fwd_bwd_TFLOPs=3 * flops / fb_ms * 1e-9))
                print(rows[-1], flush=True)
        bare_row = rows[-3]
        for r in rows[-2:]:
            r["fwd_vs_bare"] = r["fwd_TFLOPs"] / bare_row["fwd_TFLOPs"]
            r["fwd_bwd_vs_bare"] = r["fwd_bwd_TFLOPs"] / bare_row["fwd_bwd_TFLOPs"]
    print(f"hardware: measured bf16 matmul ~{MATMUL_BF16 / 1e12:.0f} TFLOP/s")
    print(table(rows, ["tokens", "experts", "case", "fwd_ms", "fwd_TFLOPs", "fwd_vs_bare", "fwd_bwd_ms",
                       "fwd_bwd_TFLOPs", "fwd_bwd_vs_bare"]))
    save("moe" + ("_quick" if a.quick else ""), {"rows": rows})


if __name__ == "__main__":
    main()
