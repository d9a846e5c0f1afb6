"""Fused SiTU-GLU on CUDA (Triton), with the same contract and result as k3.ops.situ.situ_glu.

Importing this module needs no triton; `fused_situ_available(x)` says whether x can take the fused path
(CUDA, bf16/fp16/fp32, triton importable, not disabled by K3_NO_TRITON=1). Elsewhere `situ_glu_fast` falls
back to the reference.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import on_device, triton_module, use_triton

__all__ = ["fused_situ_available", "fused_situ_glu", "situ_glu_fast"]

_BLOCK = 2048


def fused_situ_available(x: torch.Tensor) -> bool:
    return use_triton(x, "_situ_triton")


def _situ_forward(gate, up, beta_gate, beta_up):
    """(h, gate and up contiguous) of one forward launch."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = gate.numel()
    if n:
        kern = triton_module("_situ_triton")
        with on_device(gate):
            kern.situ_glu_fwd_kernel[(triton_cdiv(n, _BLOCK),)](gate, up, h, n, float(beta_gate),
                                                                float(beta_up), BLOCK=_BLOCK,
                                                                EXACT=h.dtype == torch.float32)
    return h, gate, up


class _FusedSiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta_gate, beta_up):
        h, gate, up = _situ_forward(gate, up, beta_gate, beta_up)
        ctx.save_for_backward(gate, up)
        ctx.betas = (float(beta_gate), float(beta_up))
        return h

    @staticmethod
    @once_differentiable  # the kernel's gradients are not themselves differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            kern = triton_module("_situ_triton")
            with on_device(gate):
                kern.situ_glu_bwd_kernel[(triton_cdiv(n, _BLOCK),)](gate, up, dh, dg, du, n, *ctx.betas,
                                                                    BLOCK=_BLOCK, EXACT=dg.dtype == torch.float32)
        return dg, du, None, None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fused_situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0):
    """SiTU-GLU in one Triton pass (fp32 math, output in gate's dtype). gate, up: [..., I] CUDA, same shape
    and dtype. Differentiable (its own fused backward)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"fused_situ_glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must have the same shape and dtype")
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):  # inference: no Function
        return _situ_forward(gate, up, beta_gate, beta_up)[0]
    return _FusedSiTUGLU.apply(gate, up, beta_gate, beta_up)


def situ_glu_fast(gate, up, beta_gate: float = 4.0, beta_up: float = 25.0):
    """Dispatch: the fused kernel on CUDA where triton is there, else the reference `situ_glu`."""
    if fused_situ_available(gate) and gate.shape == up.shape and gate.dtype == up.dtype:
        return fused_situ_glu(gate, up, beta_gate, beta_up)
    return situ_glu(gate, up, beta_gate, beta_up)
