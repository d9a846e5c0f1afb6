"""Triton kernels for MLA's keys (imported only through k3.ops.triton_dispatch; needs triton). One pass each way:
the forward reads the no-position halves k_nope of kv_b_proj's output [N, H, nope+v] (strided) and the shared
k_extra [N, rope] and writes the keys [N, H, nope+rope]; the backward reads ∂L/∂k and ∂L/∂v once and writes
∂L/∂kv [N, H, nope+v] and ∂L/∂k_extra [N, rope] (the heads' sum, in fp32). The torch form is a cat of a strided
view and a broadcast (CUDA's unvectorised copy), and back a reduction over the heads and a second cat.
Formulas: k3.ops.mla_keys.
"""
import torch
import triton
import triton.language as tl

from k3.ops.triton_dispatch import on_device


@triton.jit
def _keys_fwd_kernel(kv_ptr, ke_ptr, k_ptr, N, stride_kvn, stride_kvh, stride_ken,
                     H: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_ROPE: tl.constexpr):
    """Program (row block, head): k[rows, h] = [kv[rows, h, :NOPE], k_extra[rows]]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1)
    r64 = rows.to(tl.int64)[:, None]
    in_rows = (rows < N)[:, None]
    c = tl.arange(0, BLOCK_NOPE)[None, :]
    e = tl.arange(0, BLOCK_ROPE)[None, :]
    out = k_ptr + r64 * (H * (NOPE + ROPE)) + h * (NOPE + ROPE)
    mask = in_rows & (c < NOPE)
    tl.store(out + c, tl.load(kv_ptr + r64 * stride_kvn + h * stride_kvh + c, mask=mask), mask=mask)
    mask = in_rows & (e < ROPE)
    tl.store(out + NOPE + e, tl.load(ke_ptr + r64 * stride_ken + e, mask=mask), mask=mask)


@triton.jit
def _keys_bwd_kernel(dk_ptr, dv_ptr, dkv_ptr, dke_ptr, N, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
                     H: tl.constexpr, NOPE: tl.constexpr, VD: tl.constexpr, ROPE: tl.constexpr, ACC64: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_ROPE: tl.constexpr):
    """Program (row block), every head: dkv[rows, h] = [dk[rows, h, :NOPE], dv[rows, h]], and
    dk_extra[rows] = Σ_h dk[rows, h, NOPE:] accumulated in fp32 (fp64 for fp64 inputs)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)[:, None]
    in_rows = (rows < N)[:, None]
    c = tl.arange(0, BLOCK_NOPE)[None, :]
    j = tl.arange(0, BLOCK_V)[None, :]
    e = tl.arange(0, BLOCK_ROPE)[None, :]
    mask_c, mask_j, mask_e = in_rows & (c < NOPE), in_rows & (j < VD), in_rows & (e < ROPE)
    acc = tl.zeros([BLOCK_N, BLOCK_ROPE], dtype=tl.float64 if ACC64 else tl.float32)
    for h in tl.static_range(H):
        dk_row = dk_ptr + r64 * stride_dkn + h * stride_dkh
        out = dkv_ptr + r64 * (H * (NOPE + VD)) + h * (NOPE + VD)
        tl.store(out + c, tl.load(dk_row + c, mask=mask_c), mask=mask_c)
        tl.store(out + NOPE + j, tl.load(dv_ptr + r64 * stride_dvn + h * stride_dvh + j, mask=mask_j), mask=mask_j)
        acc += tl.load(dk_row + NOPE + e, mask=mask_e, other=0.0).to(acc.dtype)
    tl.store(dke_ptr + r64 * ROPE + e, acc.to(dke_ptr.dtype.element_ty), mask=mask_e)


def _block_n(width: int) -> int:
    """Rows a program: about 4K elements of its widest row part."""
    return max(1, 4096 // triton.next_power_of_2(width))


def keys_forward(kv3: torch.Tensor, ke2: torch.Tensor, nope: int) -> torch.Tensor:
    """kv3: [N, H, nope+v] and ke2: [N, rope], unit last strides. Returns the keys [N, H, nope+rope], contiguous."""
    N, H, _ = kv3.shape
    rope = ke2.shape[1]
    k = torch.empty(N, H, nope + rope, dtype=kv3.dtype, device=kv3.device)
    block_n = _block_n(nope)
    with on_device(k):
        _keys_fwd_kernel[(triton.cdiv(N, block_n), H)](
            kv3, ke2, k, N, kv3.stride(0), kv3.stride(1), ke2.stride(0), H=H, NOPE=nope, ROPE=rope,
            BLOCK_N=block_n, BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_ROPE=triton.next_power_of_2(rope))
    return k


def keys_backward(dk3: torch.Tensor, dv3: torch.Tensor, nope: int, ke_dtype: torch.dtype):
    """(∂L/∂kv [N, H, nope+v] in dk's dtype, ∂L/∂k_extra [N, rope] in ke_dtype), both contiguous, given
    ∂L/∂k [N, H, nope+rope] and ∂L/∂v [N, H, v] with unit last strides."""
    N, H, width = dk3.shape
    rope, vd = width - nope, dv3.shape[2]
    d_kv = torch.empty(N, H, nope + vd, dtype=dk3.dtype, device=dk3.device)
    d_ke = torch.empty(N, rope, dtype=ke_dtype, device=dk3.device)
    block_n = max(1, _block_n(max(nope, vd)) // 4)  # (every head a program: a quarter of the forward's rows)
    with on_device(d_kv):
        _keys_bwd_kernel[(triton.cdiv(N, block_n),)](
            dk3, dv3, d_kv, d_ke, N, dk3.stride(0), dk3.stride(1), dv3.stride(0), dv3.stride(1),
            H=H, NOPE=nope, VD=vd, ROPE=rope, ACC64=dk3.dtype == torch.float64, BLOCK_N=block_n,
            BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_V=triton.next_power_of_2(vd),
            BLOCK_ROPE=triton.next_power_of_2(rope))
    return d_kv, d_ke
