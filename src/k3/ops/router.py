"""The MoE router (SPEC §3.4): sigmoid scores in fp32, top-k of the scores plus the selection-only bias, the
chosen experts' unbiased scores renormalised and scaled.

References (plain PyTorch, never dispatching): `router_scores_reference` and `route`. Fast paths beside them:
- `router_scores` on CUDA with bf16/fp16 x: one GEMM reading x and the weight as stored, accumulating and writing
  fp32 (`torch.mm(..., out_dtype=torch.float32)`), with its own backward; the reference makes an fp32 copy of x
  (and keeps it for backward) and casts its gradient back. Under bf16 autocast an fp32 x is read in bf16, as
  autocast reads it for any GEMM, but the scores stay fp32. Off with K3_ROUTER_FP32=1.
- `route_tokens` at inference for a few rows (decode): k3's Triton kernel (`k3.ops._router_triton`) from x and
  the weight straight to the expert ids and weights, in one launch; the same selection, ties included. On by
  default on CUDA (K3_NO_TRITON=_router_triton turns it off).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from k3 import envs
from k3.ops.triton_dispatch import triton_module, use_triton_op

# Rows up to which the one-launch kernel is taken at inference (each row's programs read the whole weight, from
# L2 after the first; past a few dozen rows the GEMM + top-k path reads it once). A first guess, untimed.
KERNEL_MAX_ROWS = 64


def router_scores_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(x Wᵀ) on fp32 copies (fp64 stays fp64). x: [..., D], weight: [E, D] → [..., E].
    Under autocast too: autocast would run the GEMM, and so the scores and the bias added to them, in bf16."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(x.device.type, enabled=False):
        return torch.sigmoid(x.to(dt) @ weight.to(dt).t())


def route(scores: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True, scale: float = 1.0):
    """Top-k of `scores + bias`, ties to the lower expert id; weights from the unbiased scores.
    scores: [N, E] → (idx [N, k] int64, weights [N, k]), the k choices in descending order.

    The order of a stable descending sort (`top_k_ids`), not torch.topk's of the values: topk orders tied values
    however its kernel happens to (on the CPU ids 9 before 5 among equal scores), and it differs between devices,
    so the choice among ties would not be defined; the fused kernel follows this rule exactly."""
    idx = top_k_ids(scores + bias.to(scores.dtype), k)
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * scale


def top_k_ids(s: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest of each row of s [N, E], descending, ties to the lower id: exactly a stable
    descending sort's first k. fp32 rows take one `torch.topk` over distinct int64 keys that order the same way
    (the value's bits made monotone above, E−1−id below; distinct keys leave topk no tie to break), which on CUDA
    does not sort whole rows (the sort: 0.18 ms of each MoE layer at 32K tokens in session 39's H100 profile);
    other dtypes take the sort. NaN sorts above every number, as in torch.sort; −0.0 ties with +0.0."""
    if s.dtype != torch.float32:
        return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    bits = (s + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: −0.0 becomes +0.0
    bits = torch.where(s.isnan(), 0x7FFFFFFF, bits)  # any NaN above +inf (0x7F800000)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    E = s.shape[-1]
    keys = (monotone << 32) | torch.arange(E - 1, -1, -1, device=s.device)
    return torch.topk(keys, k, dim=-1, sorted=True).indices


class _LowPrecisionRouterLogits(torch.autograd.Function):
    """x Wᵀ in fp32 from bf16/fp16 operands without fp32 copies: `torch.mm(out_dtype=float32)` forward (exact
    products, fp32 accumulation, as the reference's fp32 GEMM of the same values). Backward with g = ∂L/∂logits
    rounded to x's dtype (a [N, E] cast): ∂L/∂x = g W (fp32 accumulation, written in x's dtype) and
    ∂L/∂W = gᵀ x, accumulated and written in fp32 then cast to W's dtype."""

    @staticmethod
    def forward(ctx, x, weight):
        w = weight.to(x.dtype)  # under autocast: fp32 master weights meet bf16 activations ([E, D], small)
        ctx.save_for_backward(x, w)
        ctx.weight_dtype = weight.dtype
        return _mm_fp32(x, w.t())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.to(x.dtype)
        grad_x = torch.mm(g, w) if ctx.needs_input_grad[0] else None
        grad_w = _mm_fp32(g.t(), x).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 for bf16/fp16 a, b. CUDA has `mm(out_dtype=)`; elsewhere (the
    CPU tests of the backward's formulas) the same values through fp32 copies."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def low_precision_gemm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype in which `router_scores` reads x for the GEMM with fp32 output, or None for the fp32 reference:
    on CUDA (unless K3_ROUTER_FP32) a bf16/fp16 x's own, and under bf16/fp16 autocast an fp32 x's autocast dtype
    (the cast autocast makes for any GEMM; k3 train's CUDA steps run so)."""
    if not x.is_cuda or envs.current().router_fp32:
        return None
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.dtype
    if x.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        return dt if dt in (torch.bfloat16, torch.float16) else None
    return None


def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`router_scores_reference`, on CUDA for bf16/fp16 x (or autocast) without fp32 copies of x or its gradient."""
    dt = low_precision_gemm_dtype(x)
    if dt is None:
        return router_scores_reference(x, weight)
    with torch.autocast("cuda", enabled=False):  # the GEMM's dtypes are chosen here, not by autocast
        logits = _LowPrecisionRouterLogits.apply(x.reshape(-1, x.shape[-1]).to(dt), weight)
        return torch.sigmoid(logits).view(*x.shape[:-1], weight.shape[0])


def use_router_kernel(x: torch.Tensor, weight: torch.Tensor, needs_grad: bool) -> bool:
    """Whether `route_tokens` takes the one-launch Triton kernel: inference, at most KERNEL_MAX_ROWS rows,
    CUDA tensors the kernel reads as they are (k3.ops.triton_dispatch.use_triton_op: inside torch.compile too,
    where the kernel is the custom op k3::route_tokens_decode)."""
    return (not needs_grad and 0 < x.shape[0] <= KERNEL_MAX_ROWS and use_triton_op(x, "_router_triton")
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32))


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                 scale: float = 1.0, tickets: Callable[[int, torch.device], torch.Tensor] | None = None):
    """(idx [N, k] int64, weights [N, k] fp32 (fp64 for fp64 x), scores [N, E]) of x [N, D]: the router whole.
    tickets(N, device): the kernel's int32 workspace of at least N zeros, which it leaves zero (see
    `k3.ops._router_triton`), asked for only when the kernel runs; a fresh one when None."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if use_router_kernel(x, weight, needs_grad):
        return triton_module("_router_triton").route_tokens(
            x, weight, bias, k, renormalize, scale, None if tickets is None else tickets(x.shape[0], x.device))
    scores = router_scores(x, weight)
    idx, w = route(scores, bias, k, renormalize, scale)
    return idx, w, scores
