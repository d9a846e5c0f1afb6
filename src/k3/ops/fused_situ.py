"""Fused SiTU-GLU on CUDA (Triton), with the same contract and result as k3.ops.situ.situ_glu.

Importing this module needs no triton; `fused_situ_available(x)` says whether x can take the fused path
(CUDA, bf16/fp16/fp32, triton importable, not disabled by K3_NO_TRITON=1). Elsewhere `situ_glu_fast` falls
back to the reference.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import on_device, row_tiles, triton_module, use_triton

__all__ = ["fused_situ_available", "fused_situ_glu", "situ_glu_fast", "situ_glu_joined"]

_TILE = 2048  # elements a program: 16 a thread at 4 warps


def _launch_grid(rows: int, cols: int) -> tuple[tuple[int, int], dict]:
    grid, block_r, block_c = row_tiles(rows, cols, _TILE)
    return grid, dict(BLOCK_R=block_r, BLOCK_C=block_c)


def fused_situ_available(x: torch.Tensor) -> bool:
    return use_triton(x, "_situ_triton")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, x.shape[-1]] with unit column stride: a view where its layout allows (a slice of a wider
    fused projection's output is one), else a contiguous copy."""
    cols = x.shape[-1] if x.dim() else 1
    if x.dim() and x.stride(-1) == 1:
        try:
            return x.view(-1, cols)
        except RuntimeError:
            pass
    return x.contiguous().view(-1, cols)


def _situ_forward(gate, up, beta_gate, beta_up):
    """h (contiguous, gate's shape) of one forward launch. gate and up are read where they lie, row by row at
    their own strides: decode's shared experts take them as slices of one fused projection, and copying them
    out first was two launches a MoE layer (session 33's H100 profile at batch 64: ~100 µs of a 3.5 ms step)."""
    g, u = _rows(gate), _rows(up)
    h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, cols = g.shape
    if g.numel():
        grid, tile = _launch_grid(rows, cols)
        kern = triton_module("_situ_triton")
        with on_device(gate):
            kern.situ_glu_fwd_kernel[grid](g, u, h, rows, cols, g.stride(0), u.stride(0), float(beta_gate),
                                           float(beta_up), EXACT=h.dtype == torch.float32, **tile)
    return h


def _situ_backward(gate, up, dh, dg, du, betas, row_stride=None):
    """dgate, dup into dg, du (gate's layout) in one launch; `row_stride`: gate and up are the halves of rows that
    far apart, and dg, du the halves of the gradient laid out alike (else all four are packed)."""
    n, cols = gate.numel(), gate.shape[-1]
    if n:
        grid, tile = _launch_grid(n // cols, cols)
        kern = triton_module("_situ_triton")
        with on_device(gate):
            kern.situ_glu_bwd_kernel[grid](gate, up, dh, dg, du, n // cols, cols, row_stride or cols, *betas,
                                           EXACT=dg.dtype == torch.float32, **tile)


class _FusedSiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta_gate, beta_up):
        # contiguous copies saved, not views: a view would keep the whole fused projection's output alive until
        # backward, and the backward kernel reads them flat
        gate, up = gate.contiguous(), up.contiguous()
        h = _situ_forward(gate, up, beta_gate, beta_up)
        ctx.save_for_backward(gate, up)
        ctx.betas = (float(beta_gate), float(beta_up))
        return h

    @staticmethod
    @once_differentiable  # the kernel's gradients are not themselves differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        _situ_backward(gate, up, dh.contiguous(), dg, du, ctx.betas)
        return dg, du, None, None


class _FusedSiTUGLUJoined(torch.autograd.Function):
    """SiTU-GLU of gu = [gate | up] (one GEMM's output, rows of 2I): the gradient comes back joined the same way,
    written by the kernel in place, so that one GEMM takes it back to the input (no sum of two input gradients)."""

    @staticmethod
    def forward(ctx, gu, beta_gate, beta_up):
        gu = gu.contiguous()
        I = gu.shape[-1] // 2
        h = _situ_forward(gu[..., :I], gu[..., I:], beta_gate, beta_up)
        ctx.save_for_backward(gu)
        ctx.betas = (float(beta_gate), float(beta_up))
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        gu, = ctx.saved_tensors
        I = gu.shape[-1] // 2
        dgu = torch.empty_like(gu)
        _situ_backward(gu[..., :I], gu[..., I:], dh.contiguous(), dgu[..., :I], dgu[..., I:], ctx.betas,
                       row_stride=2 * I)
        return dgu, None, None


def fused_situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0):
    """SiTU-GLU in one Triton pass (fp32 math, output in gate's dtype). gate, up: [..., I] CUDA, same shape
    and dtype. Differentiable (its own fused backward)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"fused_situ_glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must have the same shape and dtype")
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):  # inference: no Function
        return _situ_forward(gate, up, beta_gate, beta_up)
    return _FusedSiTUGLU.apply(gate, up, beta_gate, beta_up)


def situ_glu_fast(gate, up, beta_gate: float = 4.0, beta_up: float = 25.0):
    """Dispatch: the fused kernel on CUDA where triton is there, else the reference `situ_glu`."""
    if fused_situ_available(gate) and gate.shape == up.shape and gate.dtype == up.dtype:
        return fused_situ_glu(gate, up, beta_gate, beta_up)
    return situ_glu(gate, up, beta_gate, beta_up)


def situ_glu_joined(gu: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU(gate, up) of gu = [gate | up] along the last dim ([..., 2I] → [..., I]): the fused kernels on CUDA
    (the gradient joined like gu), else the reference on the two halves."""
    if gu.shape[-1] % 2:
        raise ValueError(f"situ_glu_joined: gu's last dim must be even (gate then up), got {tuple(gu.shape)}")
    I = gu.shape[-1] // 2
    if not fused_situ_available(gu):
        return situ_glu(gu[..., :I], gu[..., I:], beta_gate, beta_up)
    if not (torch.is_grad_enabled() and gu.requires_grad):
        return _situ_forward(gu[..., :I], gu[..., I:], beta_gate, beta_up)
    return _FusedSiTUGLUJoined.apply(gu, beta_gate, beta_up)
