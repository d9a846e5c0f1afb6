"""Decode's linears: `F.linear(x, W, b) (+ residual)`, with a Triton GEMV for the few rows of a decode step.

At batch 1..16 a decode step's linears are matrix-vector products that only have to read W once; cuBLAS reaches
about a quarter of an H200's bandwidth on them (benchmarks/RESULTS.md, "Decode, issue 21"). `linear` is the one
entry: with no gradient, at most MAX_ROWS rows, plain CUDA tensors of one float dtype, and the kernel switched
on (k3.ops.triton_dispatch: `_gemv_triton`, opt-in: on an H200 it wins only on the narrow linears, K3_TRITON), it runs k3.ops._gemv_triton's
kernel (the custom op `k3::decode_gemv`, so a torch.compile'd decode step keeps it); otherwise the plain
`linear_reference`. `DecodeLinear` is an nn.Linear whose forward is `linear` (and may take the residual add
that follows it at its call site); FusedLinears' stacked projections call `linear` themselves.
`force_gemv(True)` takes the kernel on CPU tensors too (tests, under TRITON_INTERPRET=1).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.triton_dispatch import Forced, triton_module, use_triton_op

__all__ = ["MAX_ROWS", "linear_reference", "use_gemv", "force_gemv", "linear", "DecodeLinear"]

KERNELS = "_gemv_triton"
MAX_ROWS = 16  # a decode batch; past it the weight is shared by enough rows for cuBLAS's GEMM tiles


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, plus `residual` when given. Never dispatches."""
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


force_gemv = Forced()  # `with force_gemv(True | False | None):` for `linear`, as triton_dispatch.Forced says


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, nn.Parameter)  # not a DTensor or other subclass


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes the kernel: 1..MAX_ROWS rows, no gradient wanted, one float dtype throughout, a 2-D
    weight with contiguous rows, a residual of the output's shape, no autocast, and the kernel chosen for x
    (k3.ops.triton_dispatch.use_triton_op, so inside torch.compile too) or forced on."""
    if force_gemv.value is False or (force_gemv.value is None and not x.is_cuda) or x.dim() == 0 or x.shape[-1] == 0:
        return False  # (the CPU's training and tests leave here)
    rows = x.numel() // x.shape[-1]
    fits = (0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and weight.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(t is None or (t.dtype == x.dtype and t.device == x.device) for t in (weight, bias, residual))
            and (residual is None or residual.shape == (*x.shape[:-1], weight.shape[0]))
            and _plain(x) and _plain(weight) and _plain(bias) and _plain(residual))
    if not fits or torch.is_autocast_enabled(x.device.type):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual)):
        return False
    if force_gemv.value:
        return triton_module(KERNELS) is not None
    return use_triton_op(x, KERNELS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_reference(x, weight, bias, residual)`: x [..., K], weight [N, K] → [..., N]; the GEMV kernel where
    `use_gemv` takes it (one rounding to x's dtype after the bias and residual, where the reference rounds the
    GEMM's output first)."""
    if not use_gemv(x, weight, bias, residual):
        return linear_reference(x, weight, bias, residual)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, residual.shape[-1])
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    y = _launch(x2, weight, None if bias is None else bias.contiguous(), r2)
    return y.view(*lead, weight.shape[0])


def _launch(x, weight, bias, residual):
    """The kernel, through its custom op (registered by k3.ops._gemv_triton, which `use_gemv` imported); called
    by name, not as a module attribute, which torch.compile would have to guard."""
    return torch.ops.k3.decode_gemv(x, weight, bias, residual)


class DecodeLinear(nn.Linear):
    """nn.Linear (same parameters, names and state dict) whose forward is `linear`: a decode step's few rows take
    the GEMV kernel where chosen. `residual`: added to the output (fused into the kernel's epilogue there)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, residual)
