"""KDA op on one GPU, bf16: k3's dispatch vs a direct fla chunk_kda call vs causal SDPA, forward and fwd+bwd.

Shapes (issue 6): B1 T8192 H96 D128 and B1 T32768 H32 D128. Rows:
  k3 kda_chunk        k3.ops.kda_fla.fla_kda_chunk on pre-gated inputs (k3's wrapper of fla)
  fla chunk_kda       the same call made directly (safe_gate, precomputed g)
  k3 gated            k3.ops.kda_fla.fla_kda_gated: gate, q/k L2 norm, beta sigmoid inside the kernel
  fla chunk_kda gated the same fused call made directly
  sdpa causal         F.scaled_dot_product_attention(is_causal=True), same B, T, H, D
  k3 reference        the plain-PyTorch chunked reference on the GPU (forward, first shape only)
Hardware limit printed per shape: the bytes the op must move (inputs read once, output written once) over the
copy bandwidth. Run: PYTHONPATH=src python benchmarks/bench_gpu_kda.py [--quick] [--shapes 32768x32] [--ops 'k3 gated,sdpa causal']
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import COPY_BW, fwd_bwd, save, table, time_ms  # noqa: E402

from k3.ops.kda import kda_chunk, kda_gate  # noqa: E402
from k3.ops.kda_fla import fla_kda_chunk, fla_kda_gated  # noqa: E402


def inputs(T, H, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    raw_q, raw_k, v, f = (r(1, T, H, D).bfloat16() for _ in range(4))
    b_logits = r(1, T, H).bfloat16()
    A_log, dt_bias = r(H) * 0.5, r(H * D)
    q, k = F.normalize(raw_q.float(), dim=-1).bfloat16(), F.normalize(raw_k.float(), dim=-1).bfloat16()
    g = kda_gate(f.float(), A_log, dt_bias, -5.0)
    beta = torch.sigmoid(b_logits.float()).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=beta, raw_q=raw_q, raw_k=raw_k, f=f, b_logits=b_logits,
                A_log=A_log, dt_bias=dt_bias)


def variants(x):
    from fla.ops.kda import chunk_kda

    H = x["q"].shape[2]
    return {
        "k3 kda_chunk": (lambda a: fla_kda_chunk(*a, safe_gate=True)[0], [x["q"], x["k"], x["v"], x["g"], x["beta"]]),
        "fla chunk_kda": (lambda a: chunk_kda(*a, safe_gate=True)[0], [x["q"], x["k"], x["v"], x["g"], x["beta"]]),
        "k3 gated": (lambda a: fla_kda_gated(*a, x["A_log"], x["dt_bias"], -5.0)[0],
                     [x["raw_q"], x["raw_k"], x["v"], x["f"], x["b_logits"]]),
        "fla chunk_kda gated": (lambda a: chunk_kda(*a, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                                    use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                                    lower_bound=-5.0, A_log=x["A_log"][:H], dt_bias=x["dt_bias"])[0],
                                [x["raw_q"], x["raw_k"], x["v"], x["f"], x["b_logits"]]),
        "sdpa causal": (lambda a: F.scaled_dot_product_attention(*a, is_causal=True),
                        [t.transpose(1, 2) for t in (x["q"], x["k"], x["v"])]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="8192x96,32768x32", help="TxH pairs (D=128), comma-separated")
    ap.add_argument("--ops", default="", help="comma-separated subset of the rows' op names (default: all)")
    a = ap.parse_args()
    shapes = [(int(t), int(h), 128) for t, h in (x.split("x") for x in a.shapes.split(","))]
    shapes = shapes if not a.quick else [(2048, 8, 128)]
    only = {o.strip() for o in a.ops.split(",") if o.strip()}
    reps = 10 if not a.quick else 2
    rows = []
    for T, H, D in shapes:
        x = inputs(T, H, D)
        floor_bytes = T * H * D * (2 * 3 + 4) + T * H * 2 + T * H * D * 2  # q,k,v bf16 + g fp32 + beta + o
        floor_ms = floor_bytes / COPY_BW * 1e3
        sdpa_flops = 2 * 2 * H * D * T * T / 2  # QK^T and PV, causal half
        for name, (fn, args) in variants(x).items():
            if only and name not in only:
                continue
            with torch.no_grad():
                f_ms = time_ms(lambda: fn(args), reps=reps)
            fb_ms = time_ms(fwd_bwd(fn, args), reps=reps)
            row = dict(shape=f"T{T} H{H} D{D}", op=name, fwd_ms=f_ms, fwd_bwd_ms=fb_ms,
                       mem_floor_fwd_ms=floor_ms)
            if name == "sdpa causal":
                row["TFLOPs_fwd"] = sdpa_flops / f_ms * 1e-9
            rows.append(row)
            print(row, flush=True)
        if T == shapes[0][0] and (not only or "k3 reference (torch)" in only):
            with torch.no_grad():  # the reference never dispatches to fla
                ms = time_ms(lambda: kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"]), warmup=1, reps=3)
            rows.append(dict(shape=f"T{T} H{H} D{D}", op="k3 reference (torch)", fwd_ms=ms, mem_floor_fwd_ms=floor_ms))
            print(rows[-1], flush=True)
        x = None
        torch.cuda.empty_cache()
    print(table(rows, ["shape", "op", "fwd_ms", "fwd_bwd_ms", "mem_floor_fwd_ms", "TFLOPs_fwd"]))
    save("kda" + ("_quick" if a.quick else ""), {"rows": rows})


if __name__ == "__main__":
    main()
