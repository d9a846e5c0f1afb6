"""MLA's per-head keys and values from kv_b_proj's output (SPEC §3.3: no positional encoding, so the rope-width
part k_extra is one row shared by every head): k = [k_nope, k_extra] per head, v a view. The torch reference and
the one-pass Triton kernels (k3.ops._mla_keys_triton; K3_NO_TRITON=_mla_keys_triton turns them off).

Backward: ∂L/∂kv = [∂L/∂k_nope, ∂L/∂v] per head; ∂L/∂k_extra = Σ_heads ∂L/∂k[..., nope:].
"""
import torch
from torch.autograd.function import once_differentiable

from k3.ops.triton_dispatch import triton_module, use_triton


def mla_keys_reference(kv: torch.Tensor, k_extra: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv: [..., H, nope+v_dim] (kv_b_proj's output, its heads split); k_extra: [..., rope]. Returns the keys
    [..., H, nope+rope] and the values [..., H, v_dim] (a view of kv)."""
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    k = torch.cat([k_nope, k_extra[..., None, :].expand(*k_nope.shape[:-1], k_extra.shape[-1])], dim=-1)
    return k, v


def mla_keys(kv: torch.Tensor, k_extra: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_keys_reference` in one kernel each way where the Triton kernels run (CUDA, one float dtype)."""
    if (kv.numel() and kv.dtype == k_extra.dtype and kv.shape[:-2] == k_extra.shape[:-1]
            and 0 < nope < kv.shape[-1] and use_triton(kv, "_mla_keys_triton")):
        return _MlaKeys.apply(kv, k_extra, nope)
    return mla_keys_reference(kv, k_extra, nope)


def _rows(x: torch.Tensor, trailing: int) -> torch.Tensor:
    """x with its leading dims merged into one and a unit last stride: a view where they merge, else a copy."""
    rows = x.reshape(-1, *x.shape[x.dim() - trailing:])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _MlaKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, k_extra, nope):
        kv3, ke2 = _rows(kv, 2), _rows(k_extra, 1)
        ctx.kv_shape, ctx.ke_shape, ctx.ke_dtype, ctx.nope = kv.shape, k_extra.shape, k_extra.dtype, nope
        k = triton_module("_mla_keys_triton").keys_forward(kv3, ke2, nope)
        return k.view(*kv.shape[:-1], k.shape[-1]), kv[..., nope:]

    @staticmethod
    @once_differentiable
    def backward(ctx, dk, dv):
        d_kv, d_ke = triton_module("_mla_keys_triton").keys_backward(
            _rows(dk, 2), _rows(dv, 2), ctx.nope, ctx.ke_dtype)
        return d_kv.view(ctx.kv_shape), d_ke.view(ctx.ke_shape), None
