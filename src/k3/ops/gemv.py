"""Decode's linears: `F.linear(x, W, b) (+ residual)`, with a Triton GEMV for the few rows of a decode step.

At a decode batch a step's linears are matrix-vector products, or skinny GEMMs, that only have to read W once;
cuBLAS reaches about a quarter of an H200's bandwidth on them (benchmarks/RESULTS.md, "Decode, issue 21"). `linear`
is the one entry: with no gradient, plain CUDA tensors of one float dtype, a shape where the kernel beat cuBLAS on
an H200 (`kernel_wins`: at most WIN_ROWS rows, FUSED_WIN_ROWS where a prologue comes along, and a weight of at
most WIN_WEIGHT_ELEMS elements; ONE_ROW_WEIGHT_ELEMS at one row) and the kernel
switched on (k3.ops.triton_dispatch: `_gemv_triton`, on by default on CUDA since session 26; K3_NO_TRITON), it runs
k3.ops._gemv_triton's kernel (the custom op `k3::decode_gemv`, so a torch.compile'd decode step keeps it); otherwise
the plain `linear_reference` (cuBLAS). `DecodeLinear` is an nn.Linear whose forward is `linear` (and may take the
residual add that follows it at its call site, and the RMSNorm before it: the kernel's prologue and epilogue then do
both, or the SiTU-GLU or sigmoid output gate before it: the prologue); FusedLinears' stacked projections call
`linear` themselves.
`force_gemv(True)` takes the kernel on CPU tensors too and at any shape it can run (≤ MAX_ROWS rows; tests,
under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.fused_situ import situ_glu_fast
from k3.ops.norm import rms_norm
from k3.ops.triton_dispatch import Forced, call_op, triton_module, use_triton_op

__all__ = ["MAX_ROWS", "WIN_ROWS", "WIN_WEIGHT_ELEMS", "ONE_ROW_WEIGHT_ELEMS", "FUSED_WIN_ROWS", "kernel_wins",
           "linear_reference", "use_gemv", "force_gemv", "linear", "linear_pair_reference", "use_gemv_pair",
           "linear_pair", "DecodeLinear"]

KERNELS = "_gemv_triton"
MAX_ROWS = 64  # what the kernel runs (a decode batch); where it is chosen is `kernel_wins`
# Where the kernel beat cuBLAS on an H200 (session 13, `bench_gpu_kernels.py --gemv`, small's linears, L2 cold, µs
# ours / cuBLAS at 1 row): q_b_proj [2304, 384] 2.9 / 3.5, the routed up + residual [1536, 768] 3.2 / 6.0, the shared
# experts' down [1536, 1024] 3.2 / 5.1, o_proj [1536, 1536] 5.5 / 6.5; it lost from MLA's fused input projection
# [2240, 1536] (5.7 / 5.4) up: the dense MLP [6144, 1536] 9.2 / 7.8, lm_head [32768, 1536] 34.8 / 28.4. At 8 rows it
# lost on all but KDA's input projection. So: weights of at most 2.5M elements, at most 4 rows (the FMA tiles).
WIN_ROWS = 4
WIN_WEIGHT_ELEMS = 2_500_000
# One row through the large input projections, once the FMA tiles took 4 rows of W a program (H100, session 38,
# `bench_gpu_kernels.py --gemv-sweep --gemv-rows 1,4`, µs ours / cuBLAS): KDA's [6288, 1536] 9.2 / 10.0, the MoE's
# [2816, 1536] 5.6 / 6.2, o_proj 3.7 / 5.4; at 4 rows cuBLAS keeps them (the MoE's 10.2 / 6.2). The step
# (`bench_gpu_decode.py --batches 1,4 --gemv-weight 2500000`): batch 1 1.05 -> 1.03 ms with them; batch 4 1.62 ->
# 1.83 had they gone through it at 4 rows too. So: at one row, weights up to 10M elements (not lm_head's 50M).
ONE_ROW_WEIGHT_ELEMS = 10_000_000
# Where the linear comes with a prologue (a norm, a SiTU-GLU or an output gate before it), cuBLAS's path launches
# that prologue as kernels of its own (RMSNorm 1, the GLU 1, σ(gate) ⊙ o 3), each a few µs of latency for a few KB
# at a decode batch; the kernel reads it as it loads x. Up to FUSED_WIN_ROWS rows it is taken there. Measured on
# the whole step (`bench_gpu_decode.py --contexts 4096 --batches 4,8,16 --fused-rows 16`, H100, session 37, three
# runs, ms): batch 8 1.94 / 1.94 / 1.93 -> 1.90 / 1.89 / 1.89, batch 16 2.25 / 2.24 / 2.24 -> 2.21 / 2.19 / 2.19
# (MLA's q_b with its norm and o_proj with its gate, the MoE's shared down + routed up pair: 2-3 launches fewer a
# layer); past 16 rows (the wide tiles) it lost: batch 32 2.66 -> 2.68, batch 64 3.30 -> 3.71 (`--fused-rows 64`).
FUSED_WIN_ROWS = 16


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     norm_eps: float = 0.0, glu_up: torch.Tensor | None = None,
                     glu_betas: tuple[float, float] = (4.0, 25.0), out_gate: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of x, of `rms_norm(x, norm_weight, norm_eps)` when norm_weight is given, of
    `situ_glu_fast(x, glu_up, *glu_betas)` when glu_up is (x the gate), or of `x * sigmoid(out_gate)` when
    out_gate is (MLA's gated output), plus `residual` when given. Never dispatches to the GEMV."""
    y = F.linear(_prologue(x, norm_weight, norm_eps, glu_up, glu_betas, out_gate), weight, bias)
    return y if residual is None else y + residual


def _prologue(x, norm_weight, norm_eps, glu_up, glu_betas, out_gate) -> torch.Tensor:
    """x as the linear reads it: normed, SiTU-GLU'd with glu_up, or gated by σ(out_gate) (one at most)."""
    if sum(t is not None for t in (norm_weight, glu_up, out_gate)) > 1:
        raise ValueError("linear: norm_weight, glu_up and out_gate cannot be combined (one prologue at a time)")
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps)
    if glu_up is not None:
        x = situ_glu_fast(x, glu_up, *glu_betas)
    if out_gate is not None:
        x = x * torch.sigmoid(out_gate)
    return x


def _adds_into_residual(x, weight, bias, residual) -> bool:
    """Whether `linear`'s plain path may sum x Wᵀ into the residual in place: no bias, no gradient wanted, plain
    dense tensors of one dtype and device, a contiguous residual of the output's shape, no autocast."""
    return (residual is not None and bias is None and weight.dim() == 2 and residual.is_contiguous()
            and residual.shape == (*x.shape[:-1], weight.shape[0]) and x.shape[-1] == weight.shape[1]
            and x.dtype == weight.dtype == residual.dtype and x.device == weight.device == residual.device
            and all(_plain(t) for t in (x, weight, residual)) and not torch.is_autocast_enabled(x.device.type)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, residual))))


force_gemv = Forced()  # `with force_gemv(True | False | None):` for `linear`, as triton_dispatch.Forced says


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, nn.Parameter)  # not a DTensor or other subclass


def kernel_wins(rows: int, n: int, k: int, prologue: bool = False) -> bool:
    """Whether the kernel is the faster choice for `rows` rows through an [n, k] weight (the shape classes timed
    above), `prologue`: with a norm, GLU or output gate before it that cuBLAS's path launches apart; cuBLAS
    elsewhere."""
    if rows == 1 and n * k <= ONE_ROW_WEIGHT_ELEMS:
        return True
    return rows <= (max(WIN_ROWS, FUSED_WIN_ROWS) if prologue else WIN_ROWS) and n * k <= WIN_WEIGHT_ELEMS


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
             glu_up: torch.Tensor | None = None, out_gate: torch.Tensor | None = None, fuses: bool = False) -> bool:
    """Whether `linear` takes the kernel: 1..MAX_ROWS rows, no gradient wanted, one float dtype throughout, a 2-D
    weight with contiguous rows, a residual of the output's shape, at most one prologue (a norm weight of x's
    width, or a GLU up or an output gate of x's shape with contiguous columns), no autocast, and either forced on
    or the kernel chosen for x
    (k3.ops.triton_dispatch.use_triton_op, so inside torch.compile too) at a shape where it wins (`kernel_wins`,
    with its prologue counted; `fuses`: the caller's launch stands for more than this GEMM, as `linear_pair`'s)."""
    forced = force_gemv.value
    if forced is False or x.dim() == 0 or x.shape[-1] == 0:
        return False
    if not forced and not use_triton_op(x, KERNELS):
        return False  # (the CPU's training and tests leave here)
    rows = x.numel() // x.shape[-1]
    prologue = fuses or any(t is not None for t in (norm_weight, glu_up, out_gate))
    if not forced and not (weight.dim() == 2 and kernel_wins(rows, weight.shape[0], weight.shape[1], prologue)):
        return False
    fits = (0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and weight.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(t is None or (t.dtype == x.dtype and t.device == x.device)
                    for t in (weight, bias, residual, norm_weight, glu_up, out_gate))
            and (residual is None or residual.shape == (*x.shape[:-1], weight.shape[0]))
            and (norm_weight is None or norm_weight.shape == x.shape[-1:])
            and sum(t is not None for t in (norm_weight, glu_up, out_gate)) <= 1
            and all(t is None or (t.shape == x.shape and t.stride(-1) == 1) for t in (glu_up, out_gate))
            and all(_plain(t) for t in (x, weight, bias, residual, norm_weight, glu_up, out_gate)))
    if not fits or torch.is_autocast_enabled(x.device.type):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias, residual, norm_weight, glu_up, out_gate)):
        return False
    return triton_module(KERNELS) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           norm_eps: float = 0.0, glu_up: torch.Tensor | None = None,
           glu_betas: tuple[float, float] = (4.0, 25.0), out_gate: torch.Tensor | None = None,
           into_residual: bool = False) -> torch.Tensor:
    """`linear_reference(x, weight, bias, residual, norm_weight, norm_eps, glu_up, glu_betas, out_gate)`: x [..., K],
    weight [N, K] → [..., N]; the GEMV kernel where `use_gemv` takes it (one rounding to x's dtype after the bias
    and residual, where the reference rounds the GEMM's output first; the normalised x is not rounded before the
    GEMM, the GLU's h and the gated x are, once, where the reference rounds σ(gate) too). `into_residual`: the
    residual is the caller's own scratch, which the plain path may sum into in place and return (`addmm_`: one
    GEMM with β = 1 where the reference launches a GEMM and an add; one rounding, as the kernel)."""
    if not use_gemv(x, weight, bias, residual, norm_weight, glu_up, out_gate):
        if into_residual and _adds_into_residual(x, weight, bias, residual):
            h = _prologue(x, norm_weight, norm_eps, glu_up, glu_betas, out_gate)
            residual.view(-1, weight.shape[0]).addmm_(h.reshape(-1, h.shape[-1]), weight.t())
            return residual
        return linear_reference(x, weight, bias, residual, norm_weight, norm_eps, glu_up, glu_betas, out_gate)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, residual.shape[-1])
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    g = None if norm_weight is None else norm_weight.contiguous()
    u2 = None if glu_up is None else glu_up.reshape(-1, glu_up.shape[-1])
    o2 = None if out_gate is None else out_gate.reshape(-1, out_gate.shape[-1])
    y = _launch(x2, weight, None if bias is None else bias.contiguous(), r2, g, float(norm_eps), u2,
                *(float(b) for b in glu_betas), o2)
    return y.view(*lead, weight.shape[0])


def _launch(x, weight, bias, residual, norm_weight=None, norm_eps=0.0, glu_up=None, beta_gate=4.0, beta_up=25.0,
            out_gate=None):
    """The kernel, through its custom op (registered by k3.ops._gemv_triton, which `use_gemv` imported) inside
    torch.compile, its function directly elsewhere (triton_dispatch.call_op); called by name, not as a module
    attribute, which torch.compile would have to guard."""
    return call_op("decode_gemv", x, weight, bias, residual, norm_weight, norm_eps, glu_up, beta_gate, beta_up,
                   out_gate)


def linear_pair_reference(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                          glu_up: torch.Tensor | None = None, glu_betas: tuple[float, float] = (4.0, 25.0),
                          norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """Two linears into one output: `linear_reference(a, weight_a, glu_up=...)` (a the gate when glu_up is given)
    plus `linear_reference(b, weight_b, norm_weight=...)`, each rounded as its own op. Never dispatches."""
    s = linear_reference(a, weight_a, glu_up=glu_up, glu_betas=glu_betas)
    return linear_reference(b, weight_b, residual=s, norm_weight=norm_weight, norm_eps=norm_eps)


def use_gemv_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  glu_up: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None) -> bool:
    """Whether `linear_pair` takes the one two-segment kernel: each linear would take the GEMV on its own
    (`use_gemv`, as a fused launch: the pair stands for two GEMMs, their add and their prologues), their rows and
    outputs match, one dtype."""
    return (a.shape[:-1] == b.shape[:-1] and weight_a.dim() == weight_b.dim() == 2
            and weight_a.shape[0] == weight_b.shape[0] and a.dtype == b.dtype
            and use_gemv(a, weight_a, glu_up=glu_up, fuses=True)
            and use_gemv(b, weight_b, norm_weight=norm_weight, fuses=True))


def linear_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                glu_up: torch.Tensor | None = None, glu_betas: tuple[float, float] = (4.0, 25.0),
                norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """`linear_pair_reference`: where `use_gemv_pair` takes it, one custom op `k3::decode_gemv_pair` (one launch
    for the two GEMVs' two, or for their four where K is split; one rounding of the sum); else the two
    `linear`s, the second summing into the first's output (its own scratch)."""
    if not use_gemv_pair(a, weight_a, b, weight_b, glu_up, norm_weight):
        s = linear(a, weight_a, glu_up=glu_up, glu_betas=glu_betas)
        return linear(b, weight_b, residual=s, norm_weight=norm_weight, norm_eps=norm_eps, into_residual=True)
    lead = a.shape[:-1]
    a2, b2 = (t.reshape(-1, t.shape[-1]) for t in (a, b))
    a2, b2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (a2, b2))
    u2 = None if glu_up is None else glu_up.reshape(-1, glu_up.shape[-1])
    y = _launch_pair(a2, weight_a, u2, *(float(v) for v in glu_betas), b2, weight_b,
                     None if norm_weight is None else norm_weight.contiguous(), float(norm_eps))
    return y.view(*lead, weight_a.shape[0])


def _launch_pair(a, weight_a, glu_up, beta_gate, beta_up, b, weight_b, norm_weight, norm_eps):
    """The two-segment kernel through its custom op (registered by k3.ops._gemv_triton), called by name as
    `_launch`."""
    return call_op("decode_gemv_pair", a, weight_a, glu_up, beta_gate, beta_up, b, weight_b, norm_weight, norm_eps)


class DecodeLinear(nn.Linear):
    """nn.Linear (same parameters, names and state dict) whose forward is `linear`: a decode step's few rows take
    the GEMV kernel where chosen. `residual`: added to the output (fused into the kernel's epilogue there);
    `norm`: an RMSNorm module (`weight`, `eps`) applied to x first (in the kernel's prologue and epilogue there);
    `glu_up`, `glu_betas`: the input is SiTU-GLU(x, glu_up) (x the gate; in the kernel's prologue there);
    `out_gate`: the input is x ⊙ σ(out_gate) (in the kernel's prologue there); `into_residual`: the residual is
    the caller's scratch, summed into in place where the kernel is not taken (`linear`)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: nn.Module | None = None,
                glu_up: torch.Tensor | None = None, glu_betas: tuple[float, float] = (4.0, 25.0),
                out_gate: torch.Tensor | None = None, into_residual: bool = False) -> torch.Tensor:
        norm_weight, norm_eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return linear(x, self.weight, self.bias, residual, norm_weight, norm_eps, glu_up, glu_betas, out_gate,
                      into_residual)
