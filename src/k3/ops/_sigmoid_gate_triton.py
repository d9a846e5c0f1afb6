"""Triton kernels for MLA's output gate `o ⊙ σ(gate)` (imported only through k3.ops.triton_dispatch; needs
triton). One pass each way, fp32 math in registers: the forward reads o (strided: attention's [.., H, V] output
as it comes, a slice of a wider head included) and gate once and writes the gated rows [N, H·V]; the backward
reads ∂L/∂out, o and gate once and writes ∂L/∂o and ∂L/∂gate. The torch form is a reshape copy of o, a sigmoid
and a multiply forward, three passes back. Formulas: k3.ops.sigmoid_gate.
"""
import torch
import triton
import triton.language as tl

from k3.ops._math_triton import _sigmoid_pair
from k3.ops.triton_dispatch import on_device, row_tiles


@triton.jit
def _load_tile(o_ptr, g_ptr, N, stride_on, stride_oh, H: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """This program's tile of o (strided) and gate in fp32, with the mask and the dense [N, H·V] offsets."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # over H·V
    mask = (rows < N)[:, None] & (cols < H * V)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    o_offs = r64 * stride_on + (cols // V * stride_oh + cols % V)[None, :]
    offs = r64 * (H * V) + cols[None, :]
    o = tl.load(o_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return o, g, offs, mask


@triton.jit
def _gate_fwd_kernel(o_ptr, g_ptr, out_ptr, N, stride_on, stride_oh,
                     H: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                     EXACT: tl.constexpr):
    o, g, offs, mask = _load_tile(o_ptr, g_ptr, N, stride_on, stride_oh, H, V, BLOCK_N, BLOCK_C)
    tl.store(out_ptr + offs, (o * _sigmoid_pair(g, EXACT)[0]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(o_ptr, g_ptr, dy_ptr, do_ptr, dg_ptr, N, stride_on, stride_oh,
                     H: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                     EXACT: tl.constexpr):
    o, g, offs, mask = _load_tile(o_ptr, g_ptr, N, stride_on, stride_oh, H, V, BLOCK_N, BLOCK_C)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, s_neg = _sigmoid_pair(g, EXACT)  # (σ(−g), not 1 − σ(g): no cancellation where σ(g) nears 1)
    tl.store(do_ptr + offs, (dy * s).to(do_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dy * o * s * s_neg).to(dg_ptr.dtype.element_ty), mask=mask)


def gate_forward(o3: torch.Tensor, gate2: torch.Tensor) -> torch.Tensor:
    """o3: [N, H, V] with a unit last stride; gate2: [N, H·V] contiguous. Returns [N, H·V] in gate's dtype."""
    N, H, V = o3.shape
    out = torch.empty_like(gate2)
    grid, block_n, block_c = row_tiles(N, H * V, 4096)
    with on_device(out):
        _gate_fwd_kernel[grid](o3, gate2, out, N, o3.stride(0), o3.stride(1), H=H, V=V,
                               BLOCK_N=block_n, BLOCK_C=block_c, EXACT=out.dtype == torch.float32)
    return out


def gate_backward(dy2: torch.Tensor, o3: torch.Tensor, gate2: torch.Tensor):
    """(∂L/∂o [N, H, V] contiguous in o's dtype, ∂L/∂gate [N, H·V]) given ∂L/∂out [N, H·V] contiguous."""
    N, H, V = o3.shape
    d_o = torch.empty(N, H, V, dtype=o3.dtype, device=o3.device)
    d_g = torch.empty_like(gate2)
    grid, block_n, block_c = row_tiles(N, H * V, 4096)
    with on_device(dy2):
        _gate_bwd_kernel[grid](o3, gate2, dy2, d_o, d_g, N, o3.stride(0), o3.stride(1), H=H, V=V,
                               BLOCK_N=block_n, BLOCK_C=block_c, EXACT=d_g.dtype == torch.float32)
    return d_o, d_g
