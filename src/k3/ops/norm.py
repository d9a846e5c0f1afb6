"""RMSNorm and per-head L2 normalisation, computed in float32 (float64 stays float64) and cast back."""
import torch
from torch.autograd.function import once_differentiable

from k3.ops.triton_dispatch import triton_module, use_triton


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _scaled(xf: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    y = xf * rstd
    return y if weight is None else y * weight.to(y.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` differentiated by autograd (keeps fp32 copies of x and y for backward): the tests' reference."""
    xf = x.to(_compute_dtype(x))
    return _scaled(xf, _rstd(xf, eps), weight).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w ⊙ x / sqrt(mean(x²) + eps)` over the last dim. x: [..., D], weight: [D].

    Same ops in the same order as `rms_norm_reference`; backward keeps only x and the per-row rstd [..., 1].
    On CUDA the Triton kernels of `k3.ops._norm_triton` do the same fp32 math in one pass each way (summed in
    another order, so a rounding apart, not bit-identical).
    """
    if _fused(x) and (weight is None or weight.shape == x.shape[-1:]):
        return triton_module("_norm_triton").rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def _fused(x: torch.Tensor) -> bool:
    """Whether x takes the Triton kernels: CUDA bf16/fp16/fp32 (see use_triton), non-empty, rows that fit."""
    return use_triton(x, "_norm_triton") and x.numel() > 0 and x.shape[-1] <= triton_module("_norm_triton").MAX_D


class _RMSNorm(torch.autograd.Function):
    """With x̂ = x·r, r = rsqrt(mean(x²) + eps), y = x̂ ⊙ w and g = ∂L/∂y:
    ∂L/∂w = Σ_rows g ⊙ x̂,  ∂L/∂x = r (g⊙w − x̂ · mean(g⊙w⊙x̂))."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_compute_dtype(x))
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, weight, rstd)
        return _scaled(xf, rstd, weight).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        g = grad_y.to(rstd.dtype)
        xhat = x.to(rstd.dtype) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gw = g if weight is None else g * weight.to(g.dtype)
            grad_x = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def l2_norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x²) + eps)` over the last dim in plain PyTorch (at least fp32 inside, x's dtype out)."""
    xf = x.to(_compute_dtype(x))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`l2_norm_reference` (KDA's q/k normalisation); fused on CUDA like `rms_norm`."""
    if _fused(x):
        return triton_module("_norm_triton").l2_norm(x, eps)
    return l2_norm_reference(x, eps)
