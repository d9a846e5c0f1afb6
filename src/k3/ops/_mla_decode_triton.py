"""Triton kernel for MLA's absorbed decode straight from the paged latent pool (imported only through
k3.ops.triton_dispatch; needs triton).

Each query row attends over its own context by walking its block table: no [rows, context, R] copy of the
gathered latents is ever made, which at 64 rows × 32K tokens would be 1.3 GB per layer and step. All heads of
a row share the latents (MLA's single latent "head"), so each loaded tile serves every head: scores
`q_lat · latentᵀ + q_rope · k_ropeᵀ` as two small matmuls, an online softmax, and `p · latent` into the
accumulator. Long contexts split across programs (flash-decoding); the splits are merged in PyTorch.
"""
import torch
import triton
import triton.language as tl

from k3.ops.triton_dispatch import on_device, sm_count


@triton.jit
def _paged_decode_kernel(q_lat_ptr, q_rope_ptr, kv_ptr, tables_ptr, kv_len_ptr, acc_ptr, m_ptr, l_ptr,
                         H, R, E, width, block_size, scale, split_len, splits,
                         BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    s, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r, e = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_E)
    h_ok, r_ok, e_ok = heads < H, r < R, e < E
    q_rows = (s * H + heads).to(tl.int64)
    q_lat = tl.load(q_lat_ptr + q_rows[:, None] * R + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + q_rows[:, None] * E + e[None, :], mask=h_ok[:, None] & e_ok[None, :], other=0.0)
    kv_len = tl.load(kv_len_ptr + s)
    start = sp * split_len
    end = tl.minimum(start + split_len, kv_len)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    t0 = start
    while t0 < end:  # a while loop: Triton's CPU interpreter cannot run `range` over runtime bounds
        tok = t0 + tl.arange(0, BLOCK_N)
        t_ok = tok < end
        block = tl.load(tables_ptr + s * width + tok // block_size, mask=t_ok, other=0)
        row = block.to(tl.int64) * block_size + tok % block_size
        lat = tl.load(kv_ptr + row[:, None] * (R + E) + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        k_rope = tl.load(kv_ptr + row[:, None] * (R + E) + R + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                         other=0.0)
        sc = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        sc += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        sc = tl.where(t_ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
        m = m_new
        t0 += BLOCK_N
    part = ((s * splits + sp) * H + heads).to(tl.int64)
    tl.store(acc_ptr + part[:, None] * R + r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(m_ptr + part, m, mask=h_ok)
    tl.store(l_ptr + part, l, mask=h_ok)


def paged_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                     kv_len: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """softmax(scale · (q_lat·latentᵀ + q_rope·k_ropeᵀ)) · latent for each row over its first kv_len tokens.

    q_lat: [S, H, R]; q_rope: [S, H, E]; kv: the pool [num_blocks, block_size, R + E] (latent then k_rope);
    tables: [S, width] block ids; kv_len: [S] (each >= 1, <= max_len); max_len: a host bound on kv_len that
    fixes the launch (the same bound every step keeps the launch capturable in a CUDA graph).
    Returns the context [S, H, R] in fp32.
    """
    S, H, R = q_lat.shape
    E = q_rope.shape[-1]
    block_size = kv.shape[1]
    q_lat, q_rope, tables = q_lat.contiguous(), q_rope.contiguous(), tables.contiguous()
    block_h, block_n = 16, 32  # tl.dot needs every dimension >= 16 (heads and widths are padded and masked)
    head_blocks = triton.cdiv(H, block_h)
    # Enough programs to fill the GPU when rows are few; each split at least 256 tokens.
    sms = sm_count(q_lat.device.index) if q_lat.is_cuda else 4  # the interpreter: a few splits, for the tests
    splits = max(1, min(triton.cdiv(max_len, 256), sms // (S * head_blocks)))
    split_len = block_n * triton.cdiv(triton.cdiv(max_len, splits), block_n)
    acc = torch.empty(S, splits, H, R, dtype=torch.float32, device=q_lat.device)
    m = torch.empty(S, splits, H, dtype=torch.float32, device=q_lat.device)
    l = torch.empty_like(m)
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    block_r = max(16, triton.next_power_of_2(R))
    with on_device(q_lat):
        _paged_decode_kernel[(S, head_blocks, splits)](
            q_lat, q_rope, kv, tables, kv_len, acc, m, l, H, R, E, tables.shape[1], block_size, scale, split_len,
            splits, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_N=block_n,
            PRECISION=precision, num_warps=8 if block_r >= 256 else 4)  # 4 warps spill at R = 256 (ptxas, sm_90)
    w = torch.exp(m - m.amax(1, keepdim=True))  # a split past kv_len has m = −inf and weighs 0
    return (acc * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
