"""k3's own Triton kernels against the plain-PyTorch paths they replace, at `small`'s training shapes, bf16.

Rows per op: "triton" = the kernel k3 dispatches to on CUDA; "torch" = the same call with the kernel switched
off (K3_NO_TRITON=<module>; opt-in kernels are switched on with K3_TRITON=all). Forward and
forward+backward (against one fixed random upstream gradient). Hardware limit per op: the bytes the forward must move (inputs
read once, output written once) over the copy bandwidth measured in the same run.
Ops: RMSNorm over [B, T, 1536]; L2 norm over KDA's heads [B, T, 12, 128]; the AttnRes mix of 5 sources
[B, T, 1536] (a layer late in a 4-block model); KDA's short conv [B, T, 1536], 4 taps, alone and with KDA's SiLU
after it ("triton" folds it into the conv's kernels, "torch" is the torch conv then F.silu; the row "unfused" is
the kernel conv then a separate F.silu, as before the fold); SiTU-GLU [B·T, 6144] (also in fp32) and the routed
experts' joined form [8·B·T, 2·512]; the training loss over [B·T, 32768] bf16 logits (`chunked_cross_entropy`:
"torch" is its fp32 row chunks).
KDA's 6 input projections of x [B, T, 1536] with a probe loss on each output ("triton" here: one autograd
node accumulating ∂L/∂x in the GEMMs, k3.ops.fused_linear; "torch": one nn.Linear each, summed by autograd,
K3_NO_SHARED_INPUT_GRAD=1). MLA's output gate o ⊙ σ(gate) over [B, T, 12, 128] with o a slice of 192-wide heads
as attention hands it (k3.ops._sigmoid_gate_triton against the reshape, sigmoid and multiply). MLA's keys from
kv_b_proj's [B, T, 12, 256] and the shared 64-wide k_extra sliced from kv_a_proj's output (k3.ops._mla_keys_triton
against the cat of a strided view and a broadcast, and back the heads' sum and a second cat).
The MoE router's GEMM over [B·T, 1536] → 64 experts ("triton" here: one bf16 GEMM with fp32 output and its own
backward; "torch": fp32 copies of x and the weight, K3_ROUTER_FP32=1).
Decode rows after them (forward only, no gradient, 1/8/64 rows, opt-in kernels on): the router whole ("triton":
k3.ops._router_triton's one launch; "torch": the fp32 GEMM, sigmoid, sort-based top-k, renormalisation), and a
layer's second AttnRes mix as decode runs it, 4 blocks + p + the attention output ("triton": the add, mix and
RMSNorm in one launch, k3.ops._attn_res_norm_triton; "torch": the add, the mix kernel, the norm kernel).
Decode's linears ("gemv" rows: every linear a `small` decode step runs, its shape read from the model, at 1 and 8
rows, bf16): k3.ops._gemv_triton's kernel ("triton") against cuBLAS (F.linear, plus the add where the call
site has a residual: "cublas"), each timed as a CUDA graph of calls over enough copies of the weight to leave
L2 cold (50 MB on an H200) as decode finds it; floor: the weight's bytes (and x, y, residual) over the copy
bandwidth; per_step_us: µs × the count of such calls in one decode step. --gemv: only these rows (--gemv-rows
1,8,16,32,64: at those row counts); --gemv-sweep: the kernel's launch shapes (k3.ops._gemv_triton.LAUNCH) at two
of them (at 1 and 8 rows, or at --gemv-rows).
Decode's routed experts ("moe" rows, `moe_expert_rows`: small's 64 experts, top-8, at 8 and 64 tokens, bf16): the
expert-major kernel against the grouped path k3 takes there today and the slot-major kernel; --moe: only these;
--moe-sweep: the expert-major kernel's launch shapes (k3.ops._moe_expert_major_triton.LAUNCH) instead.
--decode-sweep: only four decode kernels under their launch shapes, at small's widths, each timed as a CUDA graph of
calls: the router at 1/8/64 rows (k3.ops._router_triton.LAUNCH; floor: its weight), the slot-major routed experts
at 1/2 tokens (k3.ops._moe_decode_triton.LAUNCH; floor: the chosen experts), MLA over a StaticCache of 4K tokens
at 1/8/64 rows (k3.ops._mla_static_decode_triton.LAUNCH; floor: the cache's bytes) and KDA's step at 1/8/64 rows
(k3.ops._kda_decode_triton.LAUNCH; floor: the state and tails read and written).
--sweep: instead, the norm's kernels alone under other launch shapes (elements per row tile, warps, and backward
programs per SM of its persistent grid; k3.ops._norm_triton.FWD_LAUNCH, BWD_LAUNCH), and the AttnRes mix
(5 sources) at other warp counts, forward and backward (k3.ops._attn_res_triton.NUM_WARPS), and its backward
adding 4 blocks' gradients into their buffers (BlockGrads) against returning them for 4 separate adds (autograd's
sums).
--backwards: only the AttnRes mix backward (2..5 sources, into its buffers as training runs it) and the short
conv backward (4 taps, SiLU), each under its default launch and a few others, the MoE's slot sums (kernels
against the torch forms), and KDA's core through fla with its backward recomputing or keeping the forward's
intermediates (K3_FLA_KEEP_FORWARD), with the bytes floor and the per-step total at `small`'s call counts
(`backward_rows`).
Run: PYTHONPATH=src python benchmarks/bench_gpu_kernels.py [--tokens B,T] [--quick] [--sweep] [--only router,...]
     [--gemv [--gemv-rows 1,8]] [--gemv-sweep] [--moe] [--moe-sweep] [--decode-sweep [router,moe,mla,kda]]
     [--backwards] [--kda-core] [--kda-bwd] [--residual-add] [--conv-varlen] [--doc-attention] [--conv-l2]
--kda-core: only the KDA core rows of --backwards (`kda_core_rows`).
--kda-bwd [wy,wy_docs,intra]: only KDA's chunk-backward WY/state stage (on rows, and on documents packed in one row)
and intra-chunk stage (or those named), fla's kernels against k3.ops._kda_bwd_triton (`kda_bwd_rows`).
--conv-varlen: only serving's q/k/v short convs over a step's packed sequences, the torch path against the opt-in
kernel (`conv_varlen_rows`).
--doc-attention: only MLA's training attention over packed documents, k3's varlen path against SDPA with the
document mask (`doc_attention_rows`).
--conv-l2: only KDA's q/k short conv with its heads' L2 norm, in the conv's kernels (training's default) against the
conv's kernels then fla's l2norm (`conv_l2_rows`).
--residual-add: only a training mix with the residual add before it, the add in the mix kernel's launch against
the add separate (K3_NO_RESIDUAL_ADD_FOLD; `residual_add_rows`).
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import PEAK_BF16, changed_launch, fwd_bwd, measure_ceilings, save, table, time_ms  # noqa: E402

from k3 import envs  # noqa: E402
from k3.model.attn_res import attn_res_mix  # noqa: E402
from k3.model.norm import RMSNorm  # noqa: E402
from k3.ops.conv import short_conv  # noqa: E402
from k3.ops.cross_entropy import chunked_cross_entropy  # noqa: E402
from k3.ops.fused_situ import situ_glu_fast, situ_glu_joined  # noqa: E402
from k3.ops.norm import l2_norm, rms_norm  # noqa: E402
from k3.ops.router import route_tokens, router_scores  # noqa: E402
from k3.model.attn_res import attn_res_mix_norm  # noqa: E402
from k3.ops.fused_linear import FusedLinears  # noqa: E402
from k3.ops.mla_keys import mla_keys  # noqa: E402
from k3.ops.sigmoid_gate import sigmoid_gate  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops.gemv import MAX_ROWS, DecodeLinear, force_gemv, linear, use_gemv  # noqa: E402
from k3.ops.mla_static_decode import (static_decode_attention, static_decode_attention_reference,  # noqa: E402
                                      use_static_decode_kernel)


def cases(B: int, T: int, device: str = "cuda"):
    """name → (kernel module, fn(leaves), inputs, params, bytes the forward moves)."""
    D, H, K, I = 1536, 12, 128, 6144
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    x = r(B, T, D)
    w = torch.ones(D, device=device, dtype=torch.bfloat16, requires_grad=True)
    heads = r(B, T, H, K)
    sources = [r(B, T, D) for _ in range(5)]
    norm = RMSNorm(D, 1e-5).to(device)
    proj = torch.nn.Linear(D, 1, bias=False).to(device)
    conv_w = (torch.randn(D, 1, 4, device=device) * 0.5).requires_grad_()
    router_w = (torch.randn(64, D, device=device) * 0.05).bfloat16().requires_grad_()
    gate, up = r(B * T, I), r(B * T, I)
    gu = r(8 * B * T, 2 * 512)  # the routed experts' joined gate+up GEMM output (top-8 of 512-wide experts)
    logits, labels = r(B * T, 32768), torch.randint(0, 32768, (B * T,), device=device)
    n = B * T * D * 2
    kda_in = [torch.nn.Linear(D, o, bias=False, device=device, dtype=torch.bfloat16) for o in (D, D, D, K, H, D)]
    probes = [r(o) for o in (D, D, D, K, H, D)]
    in_proj = FusedLinears(*kda_in)
    o_wide, o_gate = r(B, T, H, 192), r(B, T, H * K)
    kv_b, kv_a = r(B, T, H * 2 * K).unflatten(-1, (H, 2 * K)), r(B, T, 256 + 64)
    return {
        "KDA input projections (6)": ({"no_shared_input_grad": True},
                                      lambda a: sum((y * c).sum() for y, c in zip(in_proj(a[0]), probes)), [x],
                                      [lin.weight for lin in kda_in], n * (1 + 4) + B * T * (K + H) * 2),
        "MLA output gate": ("_sigmoid_gate_triton", lambda a: sigmoid_gate(a[0][..., :K], a[1]), [o_wide, o_gate],
                            [], 3 * n),
        "MLA keys [k_nope, k_extra]": ("_mla_keys_triton", lambda a: mla_keys(a[0], a[1][..., 256:], K),
                                       [kv_b, kv_a], [], n * 5 // 2 + B * T * 64 * 2),
        "rms_norm": ("_norm_triton", lambda a: rms_norm(a[0], w, 1e-5), [x], [w], 2 * n),
        "l2_norm": ("_norm_triton", lambda a: l2_norm(a[0]), [heads], [], 2 * n),
        "attn_res_mix (5 sources)": ("_attn_res_triton", lambda a: attn_res_mix(list(a), norm, proj), sources,
                                     list(norm.parameters()) + list(proj.parameters()), 6 * n),
        "short_conv (4 taps)": ("_conv_triton", lambda a: short_conv(a[0], conv_w)[0], [x], [conv_w], 2 * n),
        "short_conv + SiLU": ("_conv_triton", lambda a: short_conv(a[0], conv_w, silu=True)[0], [x], [conv_w],
                              2 * n),
        "short_conv + SiLU unfused": ("_conv_triton", lambda a: F.silu(short_conv(a[0], conv_w)[0]), [x], [conv_w],
                                      2 * n),
        "cross_entropy [B·T, 32768]": ("_cross_entropy_triton", lambda a: chunked_cross_entropy(a[0], labels),
                                       [logits], [], logits.numel() * 2),
        # the switch of the "torch" side as k3.envs overrides (not a kernel module)
        "router GEMM [B·T, 1536] → 64": ({"router_fp32": True}, lambda a: router_scores(a[0], router_w), [x],
                                         [router_w], n + 64 * D * 2),
        "situ_glu": ("_situ_triton", lambda a: situ_glu_fast(a[0], a[1]), [gate, up], [], 3 * B * T * I * 2),
        # fp32 results take the kernels' exact exp (k3.ops._math_triton._exp_exact): what that precision costs
        "situ_glu fp32": ("_situ_triton", lambda a: situ_glu_fast(a[0], a[1]), [gate.float(), up.float()], [],
                          3 * B * T * I * 4),
        "situ_glu joined [8·B·T, 2·512]": ("_situ_triton", lambda a: situ_glu_joined(a[0]), [gu], [],
                                           3 * 8 * B * T * 512 * 2),
    }


def sweep_kernels(B: int, T: int):
    """The AttnRes mix (5 sources [B, T, 1536]) at 4, 8, 16 warps, backward in one kernel and in two; the norm
    kernels alone (RMSNorm [B·T, 1536] with a weight, backward dx and dw; the L2 norm over [B·T·12, 128],
    backward dx) under each launch shape. GB/s over the bytes that must move: inputs read once, gradients written once."""
    from k3.ops import _attn_res_triton as ar
    from k3.ops import _norm_triton as nt

    bw = measure_ceilings()["copy_TBps"] * 1e12
    rows, default, fwd_default = [], dict(nt.BWD_LAUNCH), dict(nt.FWD_LAUNCH)
    sources = tuple(torch.randn(B, T, 1536, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    u, w = torch.ones(1536, device="cuda"), torch.randn(1, 1536, device="cuda") * 0.05
    g = torch.randn_like(sources[0])
    _, scores, lse = ar.mix_forward(u, w, 1e-5, sources)
    warps_default = dict(ar.NUM_WARPS)
    for warps in (4, 8, 16):
        ar.NUM_WARPS.update(fwd=warps, bwd=warps)
        with torch.no_grad():
            ms = time_ms(lambda: ar.mix_forward(u, w, 1e-5, sources), inner=20)
        rows.append(dict(op="attn_res_mix fwd", tile="-", warps=warps, per_sm="-", ms=ms,
                         GBps=6 * g.numel() * 2 / ms * 1e-6))
        ms = time_ms(lambda: ar.mix_backward(g, u, w, 1e-5, sources, scores, lse), inner=20)
        # bytes that must move: g and every source read once, every source's gradient written
        rows.append(dict(op="attn_res_mix bwd", tile="-", warps=warps, per_sm="-", ms=ms,
                         GBps=11 * g.numel() * 2 / ms * 1e-6))
        print(rows[-1], flush=True)
        ar.NUM_WARPS.update(warps_default)
    # 4 blocks + p, as a late layer's mix: the blocks' gradients added into their buffers by the kernel, against
    # fresh gradients that autograd then adds into the sums (one add_ each)
    bufs = [torch.randn_like(g) for _ in range(4)]
    into = [(b, b) for b in bufs] + [None]
    ms_in = time_ms(lambda: ar.mix_backward(g, u, w, 1e-5, sources, scores, lse, into=into), inner=20)

    def returned():
        _, _, grads = ar.mix_backward(g, u, w, 1e-5, sources, scores, lse)
        for b, d in zip(bufs, grads):
            b.add_(d)
    ms_out = time_ms(returned, inner=20)
    for form, ms in (("added in the kernel", ms_in), ("returned, then 4 adds", ms_out)):
        rows.append(dict(op=f"attn_res_mix bwd, 4 block grads {form}", tile="-", warps=warps_default["bwd"],
                         per_sm="-", ms=ms, GBps=11 * g.numel() * 2 / ms * 1e-6))
        print(rows[-1], flush=True)
    for op, n_rows, D, has_w in (("rms_norm", B * T, 1536, True), ("l2_norm", B * T * 12, 128, False)):
        x = torch.randn(n_rows, D, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = torch.ones(D, device="cuda", dtype=torch.bfloat16) if has_w else None
        div = float(D) if has_w else 1.0
        rstd = torch.rsqrt(x.float().pow(2).sum(-1) / div + 1e-5)
        norm = (lambda: nt.rms_norm(x, w, 1e-5)) if has_w else (lambda: nt.l2_norm(x))
        for tile in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                nt.FWD_LAUNCH.update(tile=tile, num_warps=warps)
                try:
                    with torch.no_grad():
                        ms = time_ms(norm, inner=20)
                except Exception as e:  # a shape ptxas refuses: say so, go on
                    print(f"{op} fwd tile={tile} warps={warps}: {type(e).__name__}: {e}"[:300])
                    continue
                finally:
                    nt.FWD_LAUNCH.update(fwd_default)
                rows.append(dict(op=op + " fwd", tile=tile, warps=warps, per_sm="-", ms=ms,
                                 GBps=2 * x.numel() * 2 / ms * 1e-6))
                print(rows[-1], flush=True)
        for tile in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                for per_sm in (p for p in (1, 2, 4, 8) if p * warps <= 64):  # warps resident per SM <= 64
                    nt.BWD_LAUNCH.update(tile=tile, num_warps=warps, programs_per_sm=per_sm)
                    try:
                        ms = time_ms(lambda: nt.norm_backward(x, w, rstd, dy, div, True, has_w), inner=20)
                    except Exception as e:  # a shape ptxas refuses: say so, go on
                        print(f"{op} tile={tile} warps={warps} per_sm={per_sm}: {type(e).__name__}: {e}"[:300])
                        continue
                    finally:
                        nt.BWD_LAUNCH.update(default)
                    rows.append(dict(op=op + " bwd", tile=tile, warps=warps, per_sm=per_sm, ms=ms,
                                     GBps=3 * x.numel() * 2 / ms * 1e-6))
                    print(rows[-1], flush=True)
        ms = time_ms(lambda: nt.norm_backward(x, w, rstd, dy, div, True, has_w), inner=20)
        rows.append(dict(op=op + " bwd (default)", tile=default["tile"], warps=default["num_warps"],
                         per_sm=default["programs_per_sm"], ms=ms, GBps=3 * x.numel() * 2 / ms * 1e-6))
    print(f"B={B} T={T}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(table(sorted(rows, key=lambda r: (r["op"], r["ms"])), ["op", "tile", "warps", "per_sm", "ms", "GBps"]))
    save("kernel_sweep", {"rows": rows, "B": B, "T": T})


# calls a `small` training step makes of the AttnRes mix backward per source count (2 mixes a layer, 16 layers in 4
# blocks, then the output's mix), and of the short conv backward (3 a KDA layer, 12 KDA layers)
MIX_CALLS = {2: 8, 3: 8, 4: 8, 5: 8}
CONV_CALLS = 36


def backward_rows(B: int, T: int, device: str = "cuda") -> list[dict]:
    """The two largest backwards k3 owns at `small`'s training shapes, bf16: the AttnRes mix backward at 2..5
    sources (the blocks' gradients added in place into their buffers, the partial sum's onto a residual add's
    gradient, as training runs it) and the short conv backward (4 taps, SiLU, x and weight gradients), each
    under its default launch and the others named in `variants` (the module's settings). floor: the bytes that
    must move over the copy bandwidth; rel_err: the gradients against the default's."""
    from k3.ops import _attn_res_triton as ar
    from k3.ops import _conv_triton as ct

    bw = measure_ceilings()["copy_TBps"] * 1e12
    rows, D = [], 1536
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731

    def timed(op, module, variants, call, nbytes, calls):
        ref = None
        for name, settings in variants:
            saved = {k: getattr(module, k) for k in settings}
            for k, v in settings.items():
                setattr(module, k, dict(v) if isinstance(v, dict) else v)
            try:
                out = call()
                ms = time_ms(call, inner=10)
            finally:
                for k, v in saved.items():
                    setattr(module, k, v)
            flat = torch.cat([t.float().flatten() for t in out])
            ref = flat if ref is None else ref
            rows.append(dict(op=op, impl=name, us=ms * 1e3, floor_us=nbytes / bw * 1e6,
                             of_floor=nbytes / bw * 1e3 / ms, per_step_ms=ms * calls,
                             rel_err=((flat - ref).norm() / ref.norm()).item()))
            print(rows[-1], flush=True)

    u, w = torch.rand(D, device=device) + 0.5, torch.randn(1, D, device=device) * 0.05
    for n, calls in MIX_CALLS.items():
        sources = tuple(r(B, T, D) for _ in range(n))
        g, p_grad = r(B, T, D), r(B, T, D)
        _, scores, lse = ar.mix_forward(u, w, 1e-5, sources)
        bufs = [r(B, T, D) for _ in range(n)]

        def call():
            into = [(b, b) for b in bufs[:-1]] + [(bufs[-1], p_grad)]
            du, dw, grads = ar.mix_backward(g, u, w, 1e-5, sources, scores, lse, into=into)
            return [du, dw]  # (the gradients add into bufs on every call: compare du, dw)
        per_sm = ar.BWD_PROGRAMS_PER_SM[n]
        variants = [(f"default ({per_sm} programs an SM)", {})]
        variants += [(f"{p} programs an SM", {"BWD_PROGRAMS_PER_SM": {**ar.BWD_PROGRAMS_PER_SM, n: p}})
                     for p in (2, 3, 4) if p != per_sm]
        other = 3 - ar.BWD_STAGES  # 1 <-> 2: rows in flight a program
        variants.append((f"{other} stage(s)", {"BWD_STAGES": other}))
        timed(f"attn_res_mix bwd, {n} sources", ar, variants, call, (1 + 3 * n) * g.numel() * 2, calls)
        del sources, bufs
    x = r(B, T, D).requires_grad_()
    conv_w = (torch.randn(D, 1, 4, device=device) * 0.5).bfloat16().requires_grad_()
    y, _ = short_conv(x, conv_w, silu=True)
    dy = r(B, T, D)
    finish = lambda on: "weight grad finished in the kernel" if on else "weight grad summed by torch"  # noqa: E731
    other_c, other_w = (128, 1) if ct.BWD_BLOCK_C == 256 else (256, 2)
    wide = {"BWD_BLOCK_C": other_c, "BWD_NUM_WARPS": other_w}
    variants = [(f"default (UNROLL {ct.BWD_UNROLL}, {ct.BWD_STAGES} stages, {finish(ct.BWD_FINISH_GW)}"
                 + (", channels first)" if ct.BWD_CHANNELS_FIRST else ")"), {}),
                (finish(not ct.BWD_FINISH_GW), {"BWD_FINISH_GW": not ct.BWD_FINISH_GW}),
                ("channel blocks on grid axis 0" if not ct.BWD_CHANNELS_FIRST else "chunks on grid axis 0",
                 {"BWD_CHANNELS_FIRST": not ct.BWD_CHANNELS_FIRST}),
                (f"{other_c} channels, {other_w} warp(s)", wide),
                (f"{other_c} channels, {other_w} warp(s), channel blocks on grid axis 0",
                 {**wide, "BWD_CHANNELS_FIRST": True}),
                (f"{3 - ct.BWD_STAGES} stage(s)", {"BWD_STAGES": 3 - ct.BWD_STAGES}),
                ("UNROLL 2", {"BWD_UNROLL": 2}), ("UNROLL 8", {"BWD_UNROLL": 8}),
                ("chunks of 128", {"BWD_CHUNK_T": 128})]
    timed("short_conv + SiLU bwd", ct, variants, lambda: torch.autograd.grad(y, (x, conv_w), dy, retain_graph=True),
          4 * x.numel() * 2, CONV_CALLS)
    del x, y, dy
    rows.extend(slot_sum_rows(B * T, bw))
    rows.extend(kda_core_rows(B, T, bw))
    print(f"B={B} T={T}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(table(rows, ["op", "impl", "us", "floor_us", "of_floor", "per_step_ms", "extra_GiB", "rel_err"]))
    save("backwards", {"rows": rows, "B": B, "T": T, "copy_TBps": bw / 1e12})
    return rows

def conv_l2_rows(B: int, T: int, bw: float, device: str = "cuda", K: int = 128) -> list[dict]:
    """A training KDA layer's q (or k) short conv: SiLU(conv(x)) then the heads' L2 norm, forward and forward +
    backward (x and weight gradients), the norm in the conv's kernels (`l2_head`, k3's training default) against
    the conv's kernels then fla's own l2norm (what fla's chunk_kda runs with use_qk_l2norm_in_kernel). floor: the
    bytes that must move (forward x in, y out; backward x and dy in, dx out) over the copy bandwidth; rel_err:
    the outputs and gradients against the fused row's."""
    from fla.modules.norm.l2norm import l2norm

    C = 1536
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    x = r(B, T, C).requires_grad_()
    w = (torch.randn(C, 1, 4, device=device) * 0.5).bfloat16().requires_grad_()
    dy = r(B, T, C)
    forms = {"conv + SiLU + L2 in the conv's kernels": lambda: short_conv(x, w, silu=True, l2_head=K)[0],
             "conv + SiLU kernels, then fla's l2norm": lambda: l2norm(
                 short_conv(x, w, silu=True)[0].unflatten(-1, (-1, K))).flatten(-2)}
    rows, ref = [], None
    for impl, fwd in forms.items():
        def both():
            return [fwd().detach()] + list(torch.autograd.grad(fwd(), (x, w), dy))
        out = torch.cat([t.float().flatten() for t in both()])
        ref = out if ref is None else ref
        ms_f, ms_fb = time_ms(lambda: fwd().detach(), inner=10), time_ms(
            lambda: torch.autograd.grad(fwd(), (x, w), dy), inner=10)
        rows.append(dict(op=f"q/k short conv + L2, heads of {K}", impl=impl, fwd_us=ms_f * 1e3,
                         fwd_bwd_us=ms_fb * 1e3, floor_fwd_us=2 * x.numel() * 2 / bw * 1e6,
                         floor_fwd_bwd_us=5 * x.numel() * 2 / bw * 1e6, per_step_ms=ms_fb * 24,
                         rel_err=((out - ref).norm() / ref.norm()).item()))
        print(rows[-1], flush=True)
    return rows


def slot_sum_rows(N: int, bw: float, device: str = "cuda") -> list[dict]:
    """The MoE's sum over each token's k expert rows at `small`'s shapes (k 8, latent 768, bf16; 15 MoE layers a
    step, one call of each form a layer): the combine forward + backward (y's and the weights' gradients) and the
    dispatch gather's backward (the sum without weights), by k3.ops.slot_sum's kernels against the torch forms
    the model ran (a gather into a [N·k, L] copy, then a batched [1, k] @ [k, L] product or a sum). floor: the
    kernels' bytes (y read once each way, ∂L/∂y written once, the [N, L] rows) over the copy bandwidth."""
    from k3.ops import slot_sum as ss
    from k3.ops.token_permute import inverse_permutation, permute_rows

    k, L, calls = 8, 768, 15
    y = torch.randn(N * k, L, device=device, dtype=torch.bfloat16).requires_grad_()
    slot = torch.randperm(N * k, device=device)
    order = inverse_permutation(slot)  # permute_rows(y, slot, order) = y[slot]
    w = torch.rand(N, k, device=device, dtype=torch.bfloat16).requires_grad_()
    dout = torch.randn(N, L, device=device, dtype=torch.bfloat16)
    forms = {
        "combine fwd+bwd": (
            (3 * N * k * L + 2 * N * L) * 2,
            lambda: torch.autograd.grad(ss._SlotSum.apply(y, slot.view(N, k), w), (y, w), dout),
            lambda: torch.autograd.grad(torch.bmm(w.unsqueeze(1), permute_rows(y, slot, order).view(N, k, L))
                                        .squeeze(1), (y, w), dout)),
        "dispatch bwd (sum, no weights)": (
            (N * k * L + N * L) * 2,
            lambda: [ss._SlotSum.apply(y.detach(), slot.view(N, k), None)],
            lambda: [y.detach()[slot].view(N, k, L).sum(1)]),
    }
    rows = []
    for op, (nbytes, kernel, torch_form) in forms.items():
        ref = None
        for impl, call in (("slot_sum kernels", kernel), ("torch: gather, then bmm / sum", torch_form)):
            out = call()
            ms = time_ms(call, inner=10)
            flat = torch.cat([t.float().flatten() for t in out])
            ref = flat if ref is None else ref
            rows.append(dict(op=f"MoE slot sum, {op}", impl=impl, us=ms * 1e3, floor_us=nbytes / bw * 1e6,
                             of_floor=nbytes / bw * 1e3 / ms, per_step_ms=ms * calls,
                             rel_err=((flat - ref).norm() / ref.norm()).item()))
            print(rows[-1], flush=True)
    return rows


KDA_CALLS = 12  # KDA layers in a `small` step
DOC_TOKENS = 512  # the documents of bench_gpu_train.py --docs 512, packed into one row


def kda_core_rows(B: int, T: int, bw: float, device: str = "cuda") -> list[dict]:
    """KDA's core forward + backward at `small`'s shapes (12 heads of 128, bf16; k3.ops.kda_fla.fla_kda_gated: fla's
    chunk_kda with the gate, q/k L2 norms and beta sigmoid in its kernels), fla's backward recomputing its forward's
    intermediates (its default) against keeping them (K3_FLA_KEEP_FORWARD=1, disable_recompute). extra_GiB: the
    peak memory a call adds over its inputs (the kept intermediates live from the forward to the backward). floor:
    q, k, v, f, do read and dq, dk, dv, df, o written once over the copy bandwidth (the gate's and beta's bytes
    left out)."""
    from k3.ops.kda_fla import fla_kda_gated

    H, K = 12, 128
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    inputs = [r(B, T, H, K).bfloat16().requires_grad_() for _ in range(4)]
    inputs += [r(B, T, H).bfloat16().requires_grad_(), (r(H) * 0.5).requires_grad_(), r(H * K).requires_grad_()]
    do = r(B, T, H, K).bfloat16()

    def call():
        o, _ = fla_kda_gated(*inputs, -5.0, recurrent=False)
        return [o.detach(), *torch.autograd.grad(o, inputs, do)]

    nbytes = 10 * B * T * H * K * 2
    rows, ref = [], None
    for impl, keep in (("fla, backward recomputes (default)", False), ("fla, forward's intermediates kept", True)):
        with envs.override(fla_keep_forward=keep):
            out = call()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            call()
            extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            ms = time_ms(call, reps=10)
        flat = torch.cat([t.float().flatten() for t in out])
        ref = flat if ref is None else ref
        rows.append(dict(op="KDA core fwd+bwd (fla_kda_gated)", impl=impl, us=ms * 1e3, floor_us=nbytes / bw * 1e6,
                         of_floor=nbytes / bw * 1e3 / ms, per_step_ms=ms * KDA_CALLS, extra_GiB=extra,
                         rel_err=((flat - ref).norm() / ref.norm()).item()))
        print(rows[-1], flush=True)
    return rows


# k3.ops._kda_bwd_triton's launch choices timed beside its defaults, per stage: the module's constants and values
KDA_BWD_LAUNCH = {
    "wy": (("DQKG_BK", "DQKG_BV", "DQKG_WARPS", "DQKG_STAGES", "DQKG_MAXNREG",
            "DVA_BV", "DVA_WARPS", "DVA_STAGES", "DVA_MAXNREG"),
           [(32, 64, 4, 3, None, 32, 4, 3, None), (64, 64, 8, 2, None, 64, 8, 2, None),
            (32, 64, 4, 2, 128, 32, 4, 2, None)]),
    # session 18 timed the walk's other launches (3 stages, 8 warps, BK 16, a 128 cap: 2139-5127 us, none a win);
    # here the walk with bf16x3 diagonal dots and the sub form's launches (registers and programs an SM: sm_90
    # compile, benchmarks/sass_kda_bwd.py)
    "intra": (("INTRA_FORM", "INTRA_BK", "INTRA_WARPS", "INTRA_STAGES", "INTRA_MAXNREG", "INTRA_DIAG", "INTRA_EARLY"),
              [("walk", 32, 4, 2, None, "bf16x3", False),
               ("sub", 32, 4, 2, None, "ieee", False), ("sub", 32, 4, 2, None, "bf16x3", False),
               ("sub", 32, 4, 2, None, "bf16x3", True), ("sub", 32, 2, 2, None, "bf16x3", False),
               ("sub", 32, 1, 2, None, "bf16x3", False), ("sub", 16, 1, 2, None, "bf16x3", False),
               ("sub", 16, 1, 2, None, "bf16x3", True), ("sub", 16, 2, 2, None, "bf16x3", True)]),
}


def kda_bwd_rows(B: int, T: int, bw: float, device: str = "cuda", stages=("wy", "intra")) -> list[dict]:
    """KDA's chunk-backward stages that k3 can take from fla, each alone at `small`'s shapes (12 heads,
    K = V = 128; bf16 q, k, v and states, fp32 gates, beta and gradients as fla passes them): the WY/state stage
    (chunk_kda_bwd_wy_dqkg_fused: dq, dk, dg through the chunk states, dv2, db, dA through the WY form) and the
    intra-chunk stage (chunk_kda_bwd_intra, at the safe gate's strongest decays). Rows: fla's kernel (its autotune
    choice pinned by k3's table), k3's through fla's dispatcher (K3_KDA_BWD naming the stage, what the model runs),
    and k3.ops._kda_bwd_triton called directly under its default launch and the others of KDA_BWD_LAUNCH. floor:
    the stage's inputs read once and outputs written once over the copy bandwidth. per_step_ms: x 12 KDA layers.
    rel_err: the largest norm-wise relative difference of the outputs from fla's."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra

    from k3.ops import _kda_bwd_triton as k3_bwd
    from k3.ops import kda_fla_backend, tuning
    from k3.ops.kda_bwd_ref import intra_inputs, stage_inputs, varlen_stage_inputs

    H, K = 12, 128
    tuning.pin_for_device(torch.device(device))
    kda_fla_backend.register_with_fla()
    wy = stage_inputs(B, T, H, K, K, dtype=torch.bfloat16, device=device)
    wy[4], wy[5] = wy[4].float(), wy[5].float()
    docs, layout = [], {}
    if "wy_docs" in stages:  # the same tokens as documents packed in one row (bench_gpu_train.py --docs)
        docs, cu, chunks = varlen_stage_inputs([DOC_TOKENS] * (B * T // DOC_TOKENS), H, K, K, dtype=torch.bfloat16,
                                               device=device)
        docs[4], docs[5] = docs[4].float(), docs[5].float()
        layout = dict(cu_seqlens=cu, chunk_indices=chunks)
    intra = intra_inputs(B, T, H, K, dtype=torch.float32, device=device, strongest=True)
    intra[0], intra[1] = intra[0].bfloat16(), intra[1].bfloat16()
    # stage: (row label, inputs, fla's call, k3's call, the K3_KDA_BWD choice that hands fla's call to k3)
    calls = {"wy": ("KDA bwd wy_dqkg stage", wy, lambda: chunk_kda_bwd_wy_dqkg_fused(*wy, scale=K ** -0.5),
                    lambda: k3_bwd.chunk_kda_bwd_wy_dqkg(*wy, K ** -0.5), "wy"),
             "wy_docs": (f"KDA bwd wy_dqkg stage, documents of {DOC_TOKENS}", docs,
                         lambda: chunk_kda_bwd_wy_dqkg_fused(*docs, scale=K ** -0.5, **layout),
                         lambda: k3_bwd.chunk_kda_bwd_wy_dqkg(*docs, K ** -0.5, **layout), "wy"),
             "intra": ("KDA bwd intra stage", intra, lambda: chunk_kda_bwd_intra(*intra, safe_gate=True),
                       lambda: k3_bwd.chunk_kda_bwd_intra(*intra), "intra")}
    rows = []
    for stage, (op, x, fla_call, k3_call, choice) in [(s, calls[s]) for s in stages]:
        with envs.override(kda_bwd="fla"):
            ref = fla_call()
        floor_us = sum(t.numel() * t.element_size() for t in [*x, *ref]) / bw * 1e6

        def row(impl, fn, choice):
            with envs.override(kda_bwd=choice):
                out = fn()
                us = time_ms(fn, reps=20) * 1e3
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))
            rows.append(dict(op=op, impl=impl, us=us, floor_us=floor_us, of_floor=floor_us / us,
                             per_step_ms=us * KDA_CALLS * 1e-3, rel_err=err))
            print(rows[-1], flush=True)

        row("fla (its kernel)", fla_call, "fla")
        row(f"k3 through fla's dispatcher (K3_KDA_BWD={choice})", fla_call, choice)
        names, others = KDA_BWD_LAUNCH[choice]
        saved = tuple(getattr(k3_bwd, n) for n in names)
        try:
            for values in [saved] + [v for v in others if v != saved]:
                for n, value in zip(names, values):
                    setattr(k3_bwd, n, value)
                label = "default" if values == saved else "other"
                row(f"k3 {dict(zip(names, values))} ({label})", k3_call, "fla")
        finally:
            for n, value in zip(names, saved):
                setattr(k3_bwd, n, value)
    return rows


# the training mix forward's launch choices timed beside the default (k3.ops._attn_res_triton.LAUNCH)
FWD_LAUNCH_CHANGES = (dict(preload=True), dict(preload=True, block_r=1), dict(preload=True, block_r=4),
                      dict(block_r=1))


def residual_add_rows(B: int, T: int, bw: float, device: str = "cuda") -> list[dict]:
    """A training mix with the residual add before it (k3.model.attn_res.attn_res_mix_norm with `add`: p' = p + x,
    then the mix over [blocks, p'] and its norm), 1 and 4 blocks [B, T, 1536] bf16: the add in the mix kernel's
    forward launch (`_AttnResAddMixFused`, the default) against a separate add before it
    (K3_NO_RESIDUAL_ADD_FOLD=1). fwd: with gradients recorded (the training forward; without, inference's mix +
    norm kernel runs instead); fwd_bwd: against fixed upstream gradients for the normed mix and for p' (its other
    readers; without BlockGrads here, the separate add's side also sums those two in one more add, which the
    model's buffers do in the mix kernel either way). floor_fwd_us: the fold's forward bytes (blocks, p, x read;
    p', the mix written) over the copy bandwidth; over_default_per_step_ms: the fwd difference from the default ×
    small's 28 such mixes a step (2 a layer, less its 4 block starts; positive: slower). Further rows: the fold
    under the forward's launch choices (FWD_LAUNCH_CHANGES of its LAUNCH)."""
    from k3.ops import _attn_res_triton as ar
    D = 1536
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device).bfloat16()  # noqa: E731
    norm, out_norm = RMSNorm(D, 1e-5).to(device), RMSNorm(D, 1e-5).to(device)
    proj = torch.nn.Linear(D, 1, bias=False).to(device)
    with torch.no_grad():
        proj.weight.normal_(0, 0.05)
    rows = []
    for n_blocks in (1, 4):
        leaves = [r(B, T, D).requires_grad_() for _ in range(n_blocks + 2)]  # blocks, p, x
        g_y, g_p = r(B, T, D), r(B, T, D)
        params = list(norm.parameters()) + list(proj.parameters()) + list(out_norm.parameters())

        def fwd():
            return attn_res_mix_norm(leaves[:n_blocks], leaves[-2], norm, proj, out_norm, add=leaves[-1])

        def step():
            p, y = fwd()
            torch.autograd.grad([y, p], leaves + params, [g_y, g_p])

        default_us = None
        variants = [("add in the mix's launch (default)", False, {}), ("separate add", True, {})]
        variants += [(f"fold, {_label(change)}", False, change) for change in FWD_LAUNCH_CHANGES]
        for impl, off, change in variants:
            with envs.override(no_residual_add_fold=off), changed_launch(ar.LAUNCH, change):
                f_us, fb_us = time_ms(fwd, inner=20) * 1e3, time_ms(step, inner=10) * 1e3
            default_us = default_us or f_us
            nbytes = (n_blocks + 4) * B * T * D * 2
            rows.append(dict(op=f"residual add + mix ({n_blocks} blocks + p)", impl=impl, fwd_us=f_us,
                             fwd_bwd_us=fb_us, floor_fwd_us=nbytes / bw * 1e6,
                             over_default_per_step_ms=(f_us - default_us) * 28e-3))
            print(rows[-1], flush=True)
    return rows


def conv_varlen_rows(bw: float, device: str = "cuda", sizes=(2048, 8192), C: int = 1536) -> list[dict]:
    """Serving's q/k/v short convs over one step's packed sequences (`small`: 3 x 1536 channels, 4 taps, bf16 x as
    a column slice of the fused projections' output, fp32 tails of 64 sequences): the torch path (CPUs, and CUDA
    under K3_NO_TRITON; k3.model.kda.short_conv_varlen's window gather and einsum, then the SiLU and the split)
    against k3.ops._conv_varlen_triton's kernels (the default on CUDA since session 20). Steps of 2,048 and
    8,192 tokens: a prefill chunk of 256 per sequence, the rest decode rows of one token. floor_us: x read and y
    written once (bf16) over the copy bandwidth; per_step_ms: µs x small's 12 KDA layers."""
    from k3.model.kda import short_conv_varlen, short_conv_varlen_index
    from k3.ops._conv_varlen_triton import short_convs_varlen

    W, S = 4, 64
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for N in sizes:
        chunks = min(S, N // 256)
        lens = [256] * chunks + [1] * (S - chunks)
        lens[0] += N - sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
        seg = torch.repeat_interleave(torch.arange(S, device=device, dtype=torch.int32), cu.diff(), output_size=N)
        wide = torch.randn(N, 3 * C + 2 * C, generator=gen, device=device).bfloat16()
        x = wide[:, :3 * C]
        tails = torch.randn(S, W - 1, 3 * C, generator=gen, device=device)
        weight = torch.randn(3 * C, 1, W, generator=gen, device=device) * 0.5
        index = short_conv_varlen_index(cu, N, W)

        def torch_path():
            y, tail = short_conv_varlen(x, weight, tails, index)
            return F.silu(y.view(N, 3, C).transpose(0, 1).contiguous(), inplace=True), tail

        want = torch_path()[0]
        floor = 2 * N * 3 * C * 2 / bw * 1e6
        for impl, fn in (("torch", torch_path), ("triton (default)",
                                                           lambda: short_convs_varlen(x, weight, tails, cu, seg))):
            us = time_ms(fn, inner=20) * 1e3
            got = fn()[0]
            rows.append(dict(op=f"varlen short convs, {N} tokens", impl=impl, us=us, floor_us=floor,
                             of_floor=floor / us, per_step_ms=us * 12e-3,
                             rel_err=((got.float() - want.float()).norm() / want.float().norm()).item()))
            print(rows[-1], flush=True)
    return rows


def doc_attention_rows(device: str = "cuda", shapes=((8, 4096), (1, 32768)), doc_lens=(256, 2048, 0)) -> list[dict]:
    """MLA's training attention over packed documents (`small`: 12 heads, qk 192, v 128, bf16), forward and
    forward+backward: k3's varlen path (each document a segment of FlashAttention's varlen kernel,
    k3.ops.varlen_attention.document_attention, the packing made once a forward and left out of the timing, as the
    layers share it) against SDPA with the [B, T, T] document mask (k3's path before, and what a dense mask gives
    any SDPA user), and plain causal SDPA over whole rows (a row one document: not the same attention, the cost of
    ignoring the documents), through k3's
    `causal_attention` and with v padded to q's width (FlashAttention's one head dim, k3's call before session 46).
    Documents of a fixed length (0: one a row). floor_ms: the documents' causal FLOPs (fwd 2·H·(D+V) a visible
    pair; fwd+bwd 3.5× that) at the dense bf16 peak (989 TFLOP/s); extra_GiB: peak memory over the inputs during
    fwd+bwd."""
    from k3.ops.attention import causal_attention
    from k3.ops.varlen_attention import document_attention, packed_documents

    H, D, V = 12, 192, 128
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for B, T in shapes:
        q, k = (torch.randn(B, T, H, D, generator=gen, device=device).bfloat16().requires_grad_() for _ in range(2))
        v = torch.randn(B, T, H, V, generator=gen, device=device).bfloat16().requires_grad_()
        g = torch.randn(B, T, H, V, generator=gen, device=device).bfloat16()
        for L in doc_lens:
            L = L or T
            doc_ids = (torch.arange(T, device=device) // L).expand(B, T).contiguous()
            pairs = B * (T // L) * L * (L + 1) / 2 + B * (T % L) * (T % L + 1) / 2
            flops = 2 * H * (D + V) * pairs
            packing = packed_documents(doc_ids, device)
            impls = {"k3 varlen (documents)": lambda: document_attention(
                         q, packing.pack_keys(k), packing.pack_keys(v), D ** -0.5, packing),
                     "SDPA + [B,T,T] mask": lambda: causal_attention(q, k, v, D ** -0.5, doc_ids),
                     # k3's causal_attention: v unpadded where SDPA runs cuDNN (sm_90+, since session 46)
                     "causal SDPA, documents ignored": lambda: causal_attention(q, k, v, D ** -0.5),
                     "causal SDPA, documents ignored, v padded": lambda: F.scaled_dot_product_attention(
                         *(t.transpose(1, 2) for t in (q, k, F.pad(v, (0, D - V)))), is_causal=True,
                         scale=D ** -0.5).transpose(1, 2)[..., :V]}
            want = impls["SDPA + [B,T,T] mask"]().float()
            for impl, fn in impls.items():
                try:
                    with torch.no_grad():
                        f_ms = time_ms(fn, inner=2)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fb_ms = time_ms(lambda: torch.autograd.grad(fn(), (q, k, v), g), inner=2)
                    extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                    err = ((fn().float() - want).norm() / want.norm()).item()
                except torch.OutOfMemoryError:
                    f_ms = fb_ms = extra = err = float("nan")
                    torch.cuda.empty_cache()
                rows.append(dict(op=f"MLA attention {B}x{T}, documents of {L}", impl=impl, fwd_ms=f_ms,
                                 fwd_bwd_ms=fb_ms, floor_fwd_ms=flops / PEAK_BF16 * 1e3,
                                 floor_fwd_bwd_ms=3.5 * flops / PEAK_BF16 * 1e3,
                                 fwd_bwd_TFLOPs=3.5 * flops / fb_ms * 1e-9, extra_GiB=extra, rel_err=err))
                print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,4096", help="B,T")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time the kernels' launch shapes and forms instead")
    ap.add_argument("--backwards", action="store_true",
                    help="only the AttnRes mix and short conv backwards, new against the kernels they replaced")
    ap.add_argument("--kda-core", action="store_true",
                    help="only KDA's core forward + backward, fla recomputing against keeping its intermediates")
    ap.add_argument("--kda-bwd", nargs="?", const="wy,wy_docs,intra", default="",
                    help="only KDA's chunk-backward WY/state and intra stages (or a comma list of wy, intra), "
                         "fla's kernels against k3's")
    ap.add_argument("--conv-varlen", action="store_true",
                    help="only serving's varlen q/k/v short convs, the torch path against the opt-in kernel")
    ap.add_argument("--conv-l2", action="store_true",
                    help="only KDA's q/k short conv with the heads' L2 norm, in the conv's kernels against fla's")
    ap.add_argument("--residual-add", action="store_true",
                    help="only a training mix with its residual add folded in against the add separate")
    ap.add_argument("--doc-attention", action="store_true",
                    help="only MLA's training attention over packed documents, varlen against the masked SDPA")
    ap.add_argument("--gemv", action="store_true", help="only the decode linears' rows")
    ap.add_argument("--gemv-sweep", action="store_true", help="the GEMV kernel's launch shapes instead")
    ap.add_argument("--gemv-rows", default="1,8",
                    help="comma-separated row counts of --gemv and --gemv-sweep (up to 64)")
    ap.add_argument("--moe", action="store_true", help="only the decode MoE experts' rows")
    ap.add_argument("--moe-sweep", action="store_true", help="the expert-major kernel's launch shapes instead")
    ap.add_argument("--decode-sweep", nargs="?", const="router,moe,mla,kda", default="",
                    help="only the router, slot-major experts, MLA's StaticCache decode and KDA's decode step "
                         "under their launch shapes (or a comma list of router, moe, mla, kda)")
    ap.add_argument("--only", default="", help="comma list: only the training-shape rows whose op name contains "
                                               "one of these (the decode rows always run)")
    a = ap.parse_args()
    gemv_row_counts = tuple(int(m) for m in a.gemv_rows.split(","))
    if max(gemv_row_counts) > MAX_ROWS:
        ap.error(f"--gemv-rows {a.gemv_rows}: the GEMV kernel runs at most {MAX_ROWS} rows")
    B, T = (2, 512) if a.quick else map(int, a.tokens.split(","))
    if a.sweep:
        return sweep_kernels(B, T)
    if a.backwards:
        return backward_rows(B, T)
    if a.kda_core:
        bw = measure_ceilings()["copy_TBps"] * 1e12
        rows = kda_core_rows(B, T, bw)
        print(table(rows, ["op", "impl", "us", "floor_us", "of_floor", "per_step_ms", "extra_GiB", "rel_err"]))
        return save("kda_core", {"rows": rows, "B": B, "T": T, "copy_TBps": bw / 1e12})
    bw = measure_ceilings()["copy_TBps"] * 1e12
    if a.kda_bwd:
        rows = kda_bwd_rows(B, T, bw, stages=a.kda_bwd.split(","))
        print(f"B={B} T={T}, copy bandwidth {bw / 1e12:.2f} TB/s")
        print(table(rows, ["op", "impl", "us", "floor_us", "of_floor", "per_step_ms", "rel_err"]))
        return save("kda_bwd", {"rows": rows, "B": B, "T": T, "copy_TBps": bw / 1e12})
    if a.conv_varlen:
        rows = conv_varlen_rows(bw)
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        print(table(rows, ["op", "impl", "us", "floor_us", "of_floor", "per_step_ms", "rel_err"]))
        return save("conv_varlen", {"rows": rows, "copy_TBps": bw / 1e12})
    if a.conv_l2:
        rows = conv_l2_rows(B, T, bw)
        print(table(rows, ["op", "impl", "fwd_us", "fwd_bwd_us", "floor_fwd_us", "floor_fwd_bwd_us", "per_step_ms",
                           "rel_err"]))
        return save("conv_l2", {"rows": rows, "B": B, "T": T, "copy_TBps": bw / 1e12})
    if a.residual_add:
        rows = residual_add_rows(B, T, bw)
        print(table(rows, ["op", "impl", "fwd_us", "fwd_bwd_us", "floor_fwd_us", "over_default_per_step_ms"]))
        return save("residual_add", {"rows": rows, "B": B, "T": T, "copy_TBps": bw / 1e12})
    if a.doc_attention:
        rows = doc_attention_rows()
        print(table(rows, ["op", "impl", "fwd_ms", "fwd_bwd_ms", "floor_fwd_ms", "floor_fwd_bwd_ms", "fwd_bwd_TFLOPs",
                           "extra_GiB", "rel_err"]))
        return save("doc_attention", {"rows": rows})
    if a.gemv or a.gemv_sweep:
        gemv = gemv_sweep(bw, gemv_row_counts) if a.gemv_sweep else gemv_rows(bw, gemv_row_counts)
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        cols = ["op", "N", "K", "rows", "impl", "us", "floor_us", "GBps"]
        print(table(gemv, cols + (["launch"] if a.gemv_sweep else ["per_step_us"])))
        return save("gemv_sweep" if a.gemv_sweep else "gemv", {"rows": gemv, "copy_TBps": bw / 1e12})
    if a.decode_sweep:
        sweeps = dict(router=router_decode_sweep, moe=moe_slot_sweep, mla=mla_decode_sweep, kda=kda_decode_sweep)
        swept = [row for name in a.decode_sweep.split(",") for row in sweeps[name](bw)]
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        print(table(swept, ["op", "rows", "launch", "splits", "us", "floor_us", "of_floor"]))
        return save("decode_sweep", {"rows": swept, "copy_TBps": bw / 1e12})
    moe_cols = ["op", "rows", "max_slots", "impl", "us", "floor_us", "GBps", "rel_err"]
    if a.moe or a.moe_sweep:
        moe = moe_expert_sweep(bw) if a.moe_sweep else moe_expert_rows(bw)
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        print(table(moe, moe_cols + (["launch"] if a.moe_sweep else [])))
        return save("moe_sweep" if a.moe_sweep else "moe_experts", {"rows": moe, "copy_TBps": bw / 1e12})
    rows = []
    wanted = [w for w in a.only.split(",") if w]
    for op, (module, fn, inputs, params, nbytes) in cases(B, T).items():
        if wanted and not any(w in op for w in wanted):
            continue
        for impl in ("triton", "torch"):
            off = dict(no_triton=[module]) if isinstance(module, str) else module
            with envs.override(**({} if impl == "triton" else off), triton_opt_in=envs.ALL):
                with torch.no_grad():  # 20 calls per timing: sub-millisecond kernels, launch cost hidden
                    f_ms = time_ms(lambda: fn(inputs), inner=20)
                fb_ms = time_ms(fwd_bwd(fn, inputs, params), inner=20)
            rows.append(dict(op=op, impl=impl, fwd_ms=f_ms, fwd_bwd_ms=fb_ms, floor_fwd_ms=nbytes / bw * 1e3,
                             fwd_GBps=nbytes / f_ms * 1e-6))
            print(rows[-1], flush=True)
    print(f"B={B} T={T}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(table(rows, ["op", "impl", "fwd_ms", "fwd_bwd_ms", "floor_fwd_ms", "fwd_GBps"]))
    decode = decode_rows(bw)
    print(table(decode, ["op", "rows", "impl", "us", "floor_us"]))
    gemv = gemv_rows(bw)
    print(table(gemv, ["op", "N", "K", "rows", "impl", "us", "floor_us", "GBps", "per_step_us"]))
    moe = moe_expert_rows(bw)
    print(table(moe, moe_cols))
    save("kernels" + ("_quick" if a.quick else ""), {"rows": rows, "decode_rows": decode, "gemv_rows": gemv,
                                                      "moe_rows": moe, "B": B, "T": T})


def decode_rows(bw: float) -> list[dict]:
    """The decode kernels (forward, no gradient) against the torch ops they replace, at 1, 8 and 64 rows of
    `small`: the router whole, a layer's second AttnRes mix with the add before it and the norm after it, and
    MLA's attention over a StaticCache at 4K tokens.
    µs per call, 50 calls back to back per timing; floor: the bytes that must move over the copy bandwidth."""
    D, E, k = 1536, 64, 8
    w = torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * 0.05
    bias = torch.zeros(E, device="cuda")
    norm, out_norm = RMSNorm(D, 1e-5).cuda().bfloat16(), RMSNorm(D, 1e-5).cuda().bfloat16()
    proj = torch.nn.Linear(D, 1, bias=False).cuda().bfloat16()
    rows = []
    for n in (1, 8, 64):
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        blocks = [torch.randn(n, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        p, attn = (torch.randn(n, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        tickets = torch.zeros(n, dtype=torch.int32, device="cuda")
        ops = {"router (GEMV, sigmoid, top-8 of 64, renormalise)":
               ("_router_triton", lambda: route_tokens(x, w, bias, k, tickets=lambda *_: tickets), (E + n) * D * 2),
               "AttnRes mix + add + norm (4 blocks)":
               ("_attn_res_norm_triton", lambda: attn_res_mix_norm(blocks, p, norm, proj, out_norm, add=attn),
                8 * n * D * 2)}
        ops.update(_mla_static_decode_case(n, 4096))
        for op, (module, fn, nbytes) in ops.items():
            for impl in ("triton", "torch"):
                off = [] if impl == "triton" else [module]
                with torch.no_grad(), envs.override(no_triton=off, triton_opt_in=envs.ALL):
                    us = time_ms(fn, inner=50) / 50 * 1e3
                rows.append(dict(op=op, rows=n, impl=impl, us=us, floor_us=nbytes / bw * 1e6))
                print(rows[-1], flush=True)
    return rows


def _mla_static_decode_case(n: int, context: int) -> dict:
    """{op: (module, fn, bytes)} of MLA's absorbed decode over a StaticCache of `small` (12 heads, latent 256,
    k_extra 64) at `context` tokens: the kernel (k3.ops.mla_static_decode) or the torch ops it replaces (the
    cache write, scores, mask, softmax, context product); the same slot rewritten each call."""
    H, R, E = 12, 256, 64
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q_lat, q_rope = torch.randn(n, H, R, **bf), torch.randn(n, H, E, **bf)
    latent, k_rope = torch.randn(n, R, **bf), torch.randn(n, E, **bf)
    cache_latent, cache_k_rope = torch.randn(n, context + 1, R, **bf), torch.randn(n, context + 1, E, **bf)
    length = torch.tensor(context, device="cuda")

    def fn():
        if use_static_decode_kernel(q_lat, cache_latent, needs_grad=False):
            return static_decode_attention(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length, 0.07)
        return static_decode_attention_reference(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope,
                                                 length, 0.07)
    return {f"MLA decode over a StaticCache ({context} tokens)":
            ("_mla_static_decode_triton", fn, n * (context + 1) * (R + E) * 2)}


def router_decode_sweep(bw: float, copies: int = 300) -> list[dict]:
    """The router's one-launch kernel (k3.ops._router_triton.LAUNCH: small's 64 experts of 1536, top-8) at 1, 8
    and 64 rows under the default launch and a few others, µs a call from a CUDA graph of calls over `copies`
    router weights (59 MB: L2 cold, as each layer's router is in a decode step); floor: the weight and x."""
    from k3.ops import _router_triton as kernel

    D, E, k = 1536, 64, 8
    ws = [torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    bias = torch.zeros(E, device="cuda")
    changes = [{}, dict(block_e=8, block_d=512), dict(block_e=8), dict(block_e=2), dict(block_d=512),
               dict(rank_select_max_experts=0), dict(num_warps=8)]
    out = []
    for n in (1, 8, 64):
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        tickets = torch.zeros(n, dtype=torch.int32, device="cuda")
        out += _launch_rows("router", kernel.LAUNCH, changes, n,
                            lambda w: kernel.route_tokens(x, w, bias, k, True, 1.0, tickets),
                            (E + n) * D * 2 / bw * 1e6,
                            ws, lambda: -(-E // kernel.LAUNCH["block_e"]))
    return out


def moe_slot_sweep(bw: float) -> list[dict]:
    """The slot-major experts kernel (k3.ops._moe_decode_triton.LAUNCH), which decode takes while N·k ≤ E/4 (1 and
    2 tokens at small), under its default launch and a few others: `moe_expert_rows`' case and timing."""
    from k3.ops import _moe_decode_triton as kernel

    changes = [{}, dict(down_block_l=2), dict(down_block_l=8), dict(gate_up_block_i=4), dict(gate_up_block_i=16),
               dict(gate_up_block_l=128), dict(gate_up_block_l=1024), dict(num_warps=2), dict(num_warps=8)]
    out = []
    for change in changes:
        with changed_launch(kernel.LAUNCH, change):
            out += [dict(row, op="MoE slot-major", launch=_label(change), splits=None,
                         of_floor=row["floor_us"] / row["us"])
                    for row in moe_expert_rows(bw, batches=(1, 2), impls=("slot-major",))]
    return out


def mla_decode_sweep(bw: float, context: int = 4096, calls: int = 20) -> list[dict]:
    """MLA's StaticCache decode kernel (`_mla_static_decode_case`) at 1, 8 and 64 rows under the default launch
    and a few others (programs an SM, shortest split, warps), µs a call from a CUDA graph of `calls` calls."""
    from k3.ops import _mla_static_decode_triton as kernel

    # (sm_90 registers / spilled bytes a thread, as launched: default 255 / 8, one CTA an SM; dot16 232 / 0; dot16
    # with 64-token tiles 255 / 0, twice the bytes in flight; dot16, 4 warps, 16-token tiles 245 / 0, two CTAs an SM)
    changes = [{}, dict(prefetch=True), dict(dot16=True), dict(dot16=True, prefetch=True), dict(dot16=True, block_n=16),
               dict(block_n=16), dict(dot16=True, block_n=64),
               dict(dot16=True, block_n=16, num_warps=4, programs_per_sm=2),
               # fewer, longer splits at one row (33 of 128 tokens by default): a shorter serial merge by the last
               # program, a longer walk for each; more, shorter ones the other way
               dict(min_split=64), dict(min_split=256), dict(min_split=512)]
    out = []
    for n in (1, 8, 64):
        (_, (_, fn, nbytes)), = _mla_static_decode_case(n, context).items()
        out += _launch_rows("MLA decode", kernel.LAUNCH, changes, n, lambda _: fn(), nbytes / bw * 1e6, [None] * calls,
                            lambda: kernel.launch_shape(n, 12, context + 1, torch.device("cuda"))[1])
    return out


def kda_decode_sweep(bw: float, calls: int = 20) -> list[dict]:
    """KDA's decode step kernel (k3.ops.kda_decode.kda_decode_step: 12 heads of 128, gate rank 128, 4 taps, bf16
    projections, fp32 state and tails in a pool of 4·rows slots) at 1, 8 and 64 rows under the default launch and
    a few others (programs an SM, columns a tile, warps; `programs_per_sm=0`: one program a head, and with 8 warps
    the launch before session 25), µs a call from a CUDA graph of `calls` calls."""
    from k3.ops import _kda_decode_triton as kernel
    from k3.ops.kda_decode import DecodeWeights, kda_decode_step

    H, K, W = 12, 128, 4
    f32, bf = dict(device="cuda"), dict(device="cuda", dtype=torch.bfloat16)
    weights = DecodeWeights(*(torch.randn(H * K, 1, W, **f32) * 0.5 for _ in range(3)),
                            f_b=torch.randn(H * K, K, **bf) * K ** -0.5, A_log=torch.randn(H, **f32) * 0.5,
                            dt_bias=torch.randn(H * K, **f32), norm_weight=torch.ones(K, **f32), lower_bound=-5.0,
                            eps=1e-5)
    # wider tiles put more of the state in flight a program (MLA's lesson, session 29); sm_90 registers a thread as
    # launched, no spill in any: 32 columns, 4 warps 188; 64, 4 warps 252 (the default since session 30); 64, 8
    # warps 194; 128, 8 warps 192; 128, 16 warps 128 (a head's columns split over at most V / tile_v programs:
    # fewer splits at 1 row). The prefetch helped the 32-column tiles at 64 rows only (H100, session 30).
    # programs_per_sm=16 splits a head's columns at 64 rows too (2 programs of one 64-column tile, 4 of 32): more
    # programs to overlap one's state loads with another's arithmetic, each repeating the head's q/k/gate prologue
    changes = [{}, dict(prefetch=True), dict(programs_per_sm=2), dict(tile_v=32), dict(tile_v=32, prefetch=True),
               dict(tile_v=64, num_warps=8), dict(tile_v=128, num_warps=8), dict(programs_per_sm=16),
               dict(programs_per_sm=16, tile_v=32)]
    out = []
    for n in (1, 8, 64):
        slots = 4 * n
        feats = list(torch.randn(n, 3 * H * K + K + H + H * K, **bf).split([H * K] * 3 + [K, H, H * K], -1))
        state = torch.randn(slots, H, K, K, **f32) * 0.1
        tails = [torch.randn(slots, W - 1, H * K, **f32) for _ in range(3)]
        rows = torch.randperm(slots, device="cuda")[:n]
        nbytes = n * (2 * H * K * K * 4 + 3 * 2 * (W - 1) * H * K * 4 + 7 * H * K * 2)
        out += _launch_rows("KDA decode step", kernel.LAUNCH, changes, n,
                            lambda _: kda_decode_step(*feats, weights, state, *tails, rows), nbytes / bw * 1e6,
                            [None] * calls,
                            lambda: kernel.column_splits(n * H, K, torch.device("cuda")))
    return out


def _label(change: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in change.items()) or "default"


def _launch_rows(op: str, launch: dict, changes: list[dict], n: int, fn, floor_us: float, args: list,
                 splits) -> list[dict]:
    """One row a launch change: `launch` (a kernel module's LAUNCH) updated with it, fn timed from a CUDA graph of
    fn(a) for a in args, splits() the programs the launch splits the work over."""
    out = []
    for change in changes:
        with changed_launch(launch, change), torch.no_grad():
            parts, us = splits(), _graphed_us(fn, args)
        out.append(dict(op=op, rows=n, launch=_label(change), splits=parts, us=us, floor_us=floor_us,
                        of_floor=floor_us / us))
        print(out[-1], flush=True)
    return out


def decode_linears(preset: str = "small") -> dict[tuple[str, int, int, bool], int]:
    """(name, N, K, residual) → calls per decode step, read from the model built on the meta device: each mixer's
    and MoE's stacked input projections (FusedLinears, one GEMM at decode) and every DecodeLinear called on its
    own (not one of those stacked: the shared experts' gate and up; not KDA's f_b, which the one-kernel decode
    step reads itself)."""
    from k3.ops.fused_linear import FusedLinears, aligned_rows
    cfg = K3Config.preset(preset)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    shapes, stacked = {}, set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedLinears):
                stacked.update(id(lin) for lin in value.linears)
                rows = aligned_rows(sum(lin.out_features for lin in value.linears))  # (the stacked weight's)
                key = (f"{type(module).__name__} input projections", rows, value.linears[0].in_features, False)
                shapes[key] = shapes.get(key, 0) + 1
    for name, module in model.named_modules():
        short = name.rpartition(".")[2]
        if isinstance(module, DecodeLinear) and id(module) not in stacked and short != "f_b_proj":
            residual = short == "routed_expert_up_proj" and cfg.num_shared_experts > 0
            key = (short, module.out_features, module.in_features, residual)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def time_gemv(N: int, K: int, M: int, residual: bool, impl: str, bw: float) -> dict:
    """µs per call of one decode linear, from a CUDA graph of calls over copies of the weight (L2 cold)."""
    copies = min(64, max(2, math.ceil(256e6 / (N * K * 2))))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if residual else None
    # (the kernel forced: timed at every shape, past gemv.kernel_wins' rule, which these rows decide)
    with torch.no_grad(), envs.override(triton_opt_in=["_gemv_triton"] if impl == "triton" else []), \
            force_gemv(True if impl == "triton" else None):
        if impl == "triton":
            assert use_gemv(x, ws[0], None, r), "the GEMV kernel was not chosen"
            fn = lambda w: linear(x, w, residual=r)  # noqa: E731
        else:
            fn = lambda w: F.linear(x, w) if r is None else F.linear(x, w) + r  # noqa: E731
        for w in ws[:2]:
            fn(w)  # compile, cuBLAS's workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in ws:
                fn(w)
    us = time_ms(graph.replay, warmup=2, reps=10) / copies * 1e3
    nbytes = (N * K + M * K + M * N * (2 if residual else 1)) * 2
    del graph, ws
    return dict(N=N, K=K, rows=M, impl=impl, us=us, floor_us=nbytes / bw * 1e6, GBps=nbytes / us * 1e-3)


def gemv_rows(bw: float, rows=(1, 8)) -> list[dict]:
    """Every decode linear of `small` at each row count: the kernel against cuBLAS, and their sums per step."""
    out = []
    for M in rows:
        total = {"triton": 0.0, "cublas": 0.0}
        for (name, N, K, residual), count in decode_linears().items():
            for impl in ("triton", "cublas"):
                row = dict(op=name + (" + residual" if residual else ""), **time_gemv(N, K, M, residual, impl, bw))
                row["per_step_us"] = row["us"] * count
                total[impl] += row["per_step_us"]
                out.append(row)
                print(row, flush=True)
        for impl, us in total.items():
            out.append(dict(op="all decode linears, one step", N="-", K="-", rows=M, impl=impl, us="-",
                            floor_us="-", GBps="-", per_step_us=us))
    return out


def _applies(key: str, form: str) -> bool:
    """Whether the GEMV LAUNCH entry `key` shapes the launch of `form` (fma, dot or wide; dot_stages: both dot
    tiles)."""
    kind = key.split("_")[0]
    if key == "dot_stages":
        return form in ("dot", "wide")
    return kind not in ("fma", "dot", "wide") or kind == form


def gemv_sweep(bw: float, row_counts=(1, 8)) -> list[dict]:
    """The kernel's launch shapes (k3.ops._gemv_triton.LAUNCH) at o_proj's [1536, 1536], KDA's stacked input
    projections [6288, 1536] (6,284 rows padded: fused_linear.aligned_rows) and the MoE's [2816, 1536], at
    `row_counts` rows (--gemv-rows; default 1 and 8). Each form's entries are swept where `plan` takes it (fma,
    dot, wide; dot_stages for both dot tiles)."""
    from k3.ops import _gemv_triton  # (needs triton)
    out = []
    variants = [{}, dict(fma_block_n=4), dict(fma_block_n=16), dict(fma_tile_elems=4096),
                dict(fma_tile_elems=16384), dict(fma_warps=8), dict(programs_per_sm=1), dict(programs_per_sm=4),
                dict(dot_block_n=32), dict(dot_block_k=128), dict(dot_block_k=512), dict(dot_warps=8),
                dict(min_split_k=128), dict(min_split_k=512), dict(fma_stages=1), dict(fma_stages=3),
                dict(dot_stages=2), dict(dot_stages=4),
                # few rows through the large input projections (KDA's, the MoE's): fewer rows of W a program (H100,
                # session 38, one row: 4 rows of W beat 8 and cuBLAS at o_proj's, KDA's and the MoE's shapes)
                dict(fma_block_n=8), dict(fma_block_n=2), dict(fma_block_n=1), dict(fma_tile_elems=32768),
                dict(fma_warps=2), dict(fma_block_n=2, fma_tile_elems=16384),
                # past 16 rows (sass_gemv.py: at 64 rows x's tile is as large as W's, 96-123 KB of shared memory,
                # 1-2 CTAs an SM, 72-297 programs)
                dict(wide_block_n=32), dict(wide_block_n=128), dict(wide_block_k=64), dict(wide_block_k=256),
                dict(wide_warps=8), dict(wide_block_k=64, wide_warps=8), dict(wide_block_n=32, min_split_k=128)]
    for N, K in ((1536, 1536), (6288, 1536), (2816, 1536)):
        for M in row_counts:
            form = _gemv_triton.plan(M, N, K, torch.bfloat16, 132)["form"]
            for change in variants:
                if not all(_applies(key, form) for key in change):  # a form not taken at M rows
                    continue
                with changed_launch(_gemv_triton.LAUNCH, change):
                    out.append(dict(op="gemv", launch=_label(change), **time_gemv(N, K, M, False, "triton", bw)))
                print(out[-1], flush=True)
            out.append(dict(op="gemv", launch="cublas", **time_gemv(N, K, M, False, "cublas", bw)))
    return out


def moe_expert_rows(bw: float, batches=(8, 64), impls=("grouped (today)", "expert-major", "slot-major"),
                    hot: int = 0) -> list[dict]:
    """`small`'s routed experts at decode (64 experts, top-8, latent 768, width 512, bf16; each token's 8
    experts drawn at random, distinct; with `hot`, expert 0 among the first `hot` tokens' choices: an expert past
    one pass of 16 slots, as near-uniform routing gives some layers at 64 tokens): the expert-major kernel
    (k3::moe_expert_major, opt-in), the grouped path LatentMoE.combine_experts takes past N·k = E/4 without it
    (sort, counts, permute, torch._grouped_mm ×3, SiTU, unpermute, weighted sum) and the slot-major kernel
    (k3.ops._moe_decode_triton, one program a slot).
    µs per call from a CUDA graph of calls over 2 copies of the expert stacks (2 × 151 MB: L2 cold); floor: the
    chosen experts' weights, z and r over the copy bandwidth; rel_err: against the grouped path's answer."""
    from types import SimpleNamespace

    from k3.model.moe import Experts, LatentMoE
    from k3.ops.moe_decode import force_expert_major, use_expert_major
    from k3.ops.triton_dispatch import triton_module

    E, k, L, I = 64, 8, 768, 512
    stacks = []
    for _ in range(2):
        with torch.device("cuda"):
            experts = Experts(E, L, I).bfloat16()
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=L ** -0.5)
        stacks.append(SimpleNamespace(experts=experts, num_experts=E, qat=False, betas=(4.0, 25.0)))
    slot_kernels = triton_module("_moe_decode_triton")
    rows = []
    for n in batches:
        z = torch.randn(n, L, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(n)])
        if hot:  # expert 0 into the first `hot` tokens' choices (in place of its own slot, or of their first)
            for t in range(min(hot, n)):
                if not (idx[t] == 0).any():
                    idx[t, 0] = 0
        max_slots = torch.bincount(idx.flatten(), minlength=E).max().item()
        w = torch.rand(n, k, device="cuda", dtype=torch.bfloat16)
        nbytes = idx.unique().numel() * 3 * I * L * 2 + 2 * n * L * 2

        def combine(s):
            return LatentMoE.combine_experts(s, z, idx, w)

        def slot_major(s):
            e = s.experts
            return slot_kernels.selected_experts_situ_mlp(z, idx, w.float(), e.w1, e.w3, e.w2, 4.0, 25.0)
        ways = {"grouped (today)": (False, combine), "expert-major": (True, combine), "slot-major": (None, slot_major)}
        with torch.no_grad(), force_expert_major(False):
            want = combine(stacks[0]).float()  # rel_err's reference: the grouped path
        for impl in impls:
            force, fn = ways[impl]
            with torch.no_grad(), envs.override(triton_opt_in=envs.ALL), force_expert_major(force):
                taken = use_expert_major(z, k, E, torch.bfloat16, needs_grad=False)
                assert taken == (impl == "expert-major") or force is None, (impl, taken)
                out = fn(stacks[0]).float()
                us = _graphed_us(fn, stacks)
            rows.append(dict(op="decode MoE experts (small)", rows=n, max_slots=max_slots, impl=impl, us=us,
                             floor_us=nbytes / bw * 1e6,
                             GBps=nbytes / us * 1e-3, rel_err=((out - want).norm() / want.norm()).item()))
            print(rows[-1], flush=True)
    return rows


def moe_expert_sweep(bw: float) -> list[dict]:
    """The expert-major kernel's launch shapes (k3.ops._moe_expert_major_triton.LAUNCH) at 8 and 64 tokens, after
    one untimed pass of the default (session 35, H100: the first rows timed read ~10% slow, warming the card)."""
    from k3.ops import _moe_expert_major_triton as kernels  # (needs triton)
    moe_expert_rows(bw, impls=("expert-major",))
    variants = [{}, dict(split_passes_from=0), dict(split_passes_from=4), dict(prefetch=True), dict(gate_up_block_i=32),
                dict(gate_up_block_i=128), dict(gate_up_block_l=128),
                dict(down_block_l=32), dict(down_block_l=128), dict(wide_l_from=0), dict(wide_l_from=1 << 20),
                dict(down_block_i=128), dict(stages=2), dict(stages=4), dict(warps=8), dict(scan=64),
                dict(wide_m_from=0)]
    out = []
    for change in variants:
        with changed_launch(kernels.LAUNCH, change):
            out += [dict(row, launch=_label(change)) for hot in (0, 24)
                    for row in moe_expert_rows(bw, (8, 64) if not hot else (64,), ("expert-major",), hot)]
    return out


def _graphed_us(fn, args: list) -> float:
    """µs per call of fn(a), from one CUDA graph of fn over every a in args."""
    for a in args:
        fn(a)  # compile, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args:
            fn(a)
    us = time_ms(graph.replay, warmup=2, reps=10) / len(args) * 1e3
    del graph
    return us


if __name__ == "__main__":
    main()
