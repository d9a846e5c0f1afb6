"""Two stages of KDA's chunk backward as Triton kernels, with fla 0.6's inputs, outputs and layouts
(k3.ops.kda_fla_backend hands them to fla's dispatcher; plain PyTorch references: k3.ops.kda_bwd_ref).

`chunk_kda_bwd_wy_dqkg` (fla's `chunk_kda_bwd_wy_dqkg_fused`): after the state-gradient pass, the gradients that
flow through each chunk's state h and through its WY form. Per chunk of BT tokens (g a base-2 log-decay cumsum
within the chunk, gn its last row, A the chunk's WY matrix, dv the state pass's gradient of v_new):
    dq = scale 2^g ⊙ (do h^T)                     dk = 2^(gn-g) ⊙ (v_new dh^T) + β 2^g ⊙ (A^T dw)
    dw = -dv h^T                                   dg = q ⊙ dq - k ⊙ dk_h + [last row] dgn + β kg ⊙ (A^T dw)
    dv2 = β ⊙ (A^T dv)                              db = rowsum(A^T dv ⊙ (v - kg h))
    dA = -mask(A^T (mask(dv (v - kg h)^T) ⊙ β_col) A^T),   kg = k ⊙ 2^g
fla computes all of this in one program a chunk, which holds four [BT, BK] accumulators and the [BT, BT] dA across
its K loop: 255 registers and ~1.4 KB of spills a thread, 2 programs an SM (benchmarks/sass_kda_bwd.py).
Here the work is split by what it needs:
- `_dqkg_kernel`: one program per (K block, chunk, head): dq, dk, dg of its K columns. Three accumulators.
- `_dv_dA_kernel`: one program per (chunk, head): dv2, db and dA. fla sums dA's and db's K-dependent part over K
  blocks (-dw kg^T); since dw = -dv h^T that part is -dv (kg h)^T, so one pass over V with kg h formed there
  (one more [BT, K] x [K, BV] product a tile, far cheaper than the spills; kg formed once, over the whole K) gives
  dA and db whole: no cross-program sum.

`chunk_kda_bwd_intra` (fla's `chunk_kda_bwd_intra`): the gradients through the chunk's intra-chunk scores Aqk and
Akk added to dq, dk, db, dg: `_intra_kernel` (one program per (K block, chunk, head)) or `_intra_sub_kernel` (one
per (K block and sub-chunk, chunk, head)), as INTRA_FORM names; see their docstrings.

Each kernel moves its pointers to the program's row and head once (64-bit scalars) and indexes tiles with int32
offsets: 64-bit offset tiles took ~90 registers a thread in each.
"""
import torch
import triton
import triton.language as tl

from k3.ops.triton_dispatch import on_device

CHUNK = 64
# Tiles, warps, pipeline stages and register caps of the two kernels, chosen by their sm_90 compile
# (benchmarks/sass_kda_bwd.py): the largest 4-warp tiles that keep every value in registers.
# _dqkg_kernel: at BK 32 and 2 stages, 144 registers, no spills, 3 programs an SM (fla's: 2); at BK 64 it spills
# (three fp32 [BT, 64] accumulators and the epilogue's gate tiles pass 255 registers). _dv_dA_kernel at BV 32 under
# a 168-register cap: no spills, 3 programs an SM (uncapped ~235, 2; BV 64 spills). Timed on an H200
# (bench_gpu_kernels.py --kda-bwd, 8x4096, session 18), the stage took 1082 us under those caps and 1007 us with
# _dqkg_kernel capped at 128 registers and _dv_dA_kernel uncapped (fla's kernel: 2454 us): the caps below.
DQKG_BK, DQKG_BV, DQKG_WARPS, DQKG_STAGES, DQKG_MAXNREG = 32, 64, 4, 2, 128
DVA_BV, DVA_WARPS, DVA_STAGES, DVA_MAXNREG = 32, 4, 2, None


@triton.jit
def _chunk_of_program(i_t, i_b, T, cu_seqlens, chunk_indices, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(the chunk's index among its sequence's, the sequence's first token, its length, the chunk's row in h) for
    program i_t of row i_b: rows of T tokens, or (IS_VARLEN, one row) the sequences of cu_seqlens, program i_t
    taking the chunk chunk_indices[i_t] = (sequence, chunk within it), as fla lays out varlen calls."""
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_tg = (i_b * tl.cdiv(T, BT) + i_t).to(tl.int64)
        bos = (i_b * T).to(tl.int64)
    return i_t, bos, T, i_tg


@triton.jit
def _dqkg_kernel(q, k, v_new, g, beta, A, h, do, dh, dv, dq, dk, dg, scale, T,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, ACC: tl.constexpr, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T, i_tg = _chunk_of_program(i_t, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    # every pointer moved to this row, head (and chunk state) once, as a 64-bit scalar: the tile offsets below are
    # int32 (a row's T x H x max(K, V, BT) < 2^31, the verifier's check). 64-bit offset tiles cost ~90 registers.
    rows_k, rows_v = bos * (H * K) + i_h * K, bos * (H * V) + i_h * V
    q, k, g, dq, dk, dg = q + rows_k, k + rows_k, g + rows_k, dq + rows_k, dk + rows_k, dg + rows_k
    v_new, do, dv = v_new + rows_v, do + rows_v, dv + rows_v
    A += bos * (H * BT) + i_h * BT
    beta += bos * H + i_h
    state = (i_tg * H + i_h) * K * V
    h, dh = h + state, dh + state
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_tk = m_t[:, None]
    last = tl.minimum(T, i_t * BT + BT) - 1
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    tile_v = o_t[:, None] * (H * V) + o_v[None, :]  # [BT, BV] of v_new, do, dv
    tile_h = o_k[:, None] * V + o_v[None, :]        # [BK, BV] of h, dh (K-first)

    b_dq = tl.zeros([BT, BK], dtype=ACC)
    b_dk = tl.zeros([BT, BK], dtype=ACC)
    b_dw = tl.zeros([BT, BK], dtype=ACC)
    b_dgn = tl.zeros([BK], dtype=ACC)  # sum over V of h ⊙ dh: the last row's share of dg
    for i_v in range(0, V, BV):
        b_do = tl.load(do + tile_v + i_v, mask=m_tk, other=0.0)
        b_vn = tl.load(v_new + tile_v + i_v, mask=m_tk, other=0.0)
        b_dv = tl.load(dv + tile_v + i_v, mask=m_tk, other=0.0)
        b_h = tl.load(h + tile_h + i_v)
        b_dh = tl.load(dh + tile_h + i_v)
        b_dgn += tl.sum(b_h.to(ACC) * b_dh.to(ACC), axis=1)
        b_dq = tl.dot(b_do, tl.trans(b_h.to(b_do.dtype)), b_dq, out_dtype=ACC)
        b_dk = tl.dot(b_vn, tl.trans(b_dh.to(b_vn.dtype)), b_dk, out_dtype=ACC)
        b_dw = tl.dot(b_dv.to(b_do.dtype), tl.trans(b_h.to(b_do.dtype)), b_dw, out_dtype=ACC)

    # the epilogue in the order that lets each [BT, BK] tile die early (registers, not spills)
    tile_k = o_t[:, None] * (H * K) + o_k[None, :]
    b_g = tl.load(g + tile_k, mask=m_tk, other=0.0).to(ACC)
    b_eg = tl.exp2(b_g)
    b_dq = b_dq * b_eg * scale
    tl.store(dq + tile_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_dg = tl.load(q + tile_k, mask=m_tk, other=0.0).to(ACC) * b_dq
    b_gn = tl.load(g + last * (H * K) + o_k).to(ACC)
    b_dk = tl.where(m_tk, b_dk * tl.exp2(b_gn[None, :] - b_g), 0.0)  # through the state update
    b_k = tl.load(k + tile_k, mask=m_tk, other=0.0).to(ACC)
    b_kdk = b_k * b_dk
    b_dg -= b_kdk
    b_dgn = b_dgn * tl.exp2(b_gn) + tl.sum(b_kdk, axis=0)
    b_dg += tl.where(o_t[:, None] == last, b_dgn[None, :], 0.0)
    # A^T: element [j, i] = A[i, j] of the chunk's rows i
    o_a = tl.arange(0, BT)
    b_At = tl.load(A + o_t[None, :] * (H * BT) + o_a[:, None], mask=m_t[None, :], other=0.0)
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(ACC)
    b_dkgb = tl.dot(b_At, (-b_dw).to(b_At.dtype), out_dtype=ACC) * b_eg * b_beta[:, None]  # β 2^g ⊙ A^T dw
    b_dg += b_k * b_dkgb
    b_dk += b_dkgb
    tl.store(dk + tile_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + tile_k, b_dg.to(dg.dtype.element_ty), mask=m_tk)


@triton.jit
def _dv_dA_kernel(k, v, g, beta, A, h, dv, dv2, db, dA, T,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                  ACC: tl.constexpr, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T, i_tg = _chunk_of_program(i_t, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)
    # pointers moved to this row and head once; int32 tile offsets (as _dqkg_kernel)
    rows_k, rows_v, rows_a = bos * (H * K) + i_h * K, bos * (H * V) + i_h * V, bos * (H * BT) + i_h * BT
    k, g = k + rows_k, g + rows_k
    v, dv, dv2 = v + rows_v, dv + rows_v, dv2 + rows_v
    A, dA = A + rows_a, dA + rows_a
    beta, db = beta + bos * H + i_h, db + bos * H + i_h
    h += (i_tg * H + i_h) * K * V
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_tk = m_t[:, None]
    o_v = tl.arange(0, BV)
    o_a = tl.arange(0, BT)
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(ACC)
    b_At = tl.load(A + o_t[None, :] * (H * BT) + o_a[:, None], mask=m_t[None, :], other=0.0)

    # kg = k ⊙ 2^g over the whole K, once: every V tile's kg h needs all of it
    o_kk = tl.arange(0, K)
    tile_k = o_t[:, None] * (H * K) + o_kk[None, :]
    b_k = tl.load(k + tile_k, mask=m_tk, other=0.0)
    b_g = tl.load(g + tile_k, mask=m_tk, other=0.0).to(ACC)
    b_kg = (b_k.to(ACC) * tl.exp2(b_g)).to(b_k.dtype)
    tile_v = o_t[:, None] * (H * V) + o_v[None, :]
    tile_h = o_kk[:, None] * V + o_v[None, :]
    b_dA = tl.zeros([BT, BT], dtype=ACC)
    b_db = tl.zeros([BT], dtype=ACC)
    for i_v in range(0, V, BV):
        b_dv = tl.load(dv + tile_v + i_v, mask=m_tk, other=0.0)
        b_v = tl.load(v + tile_v + i_v, mask=m_tk, other=0.0)
        b_h = tl.load(h + tile_h + i_v)
        b_y = b_v.to(ACC) - tl.dot(b_kg, b_h.to(b_kg.dtype), out_dtype=ACC)  # v - kg h for these V columns
        b_dA = tl.dot(b_dv, tl.trans(b_y.to(b_dv.dtype)), b_dA, out_dtype=ACC)
        b_dvb = tl.dot(b_At, b_dv.to(b_At.dtype), out_dtype=ACC)  # A^T dv
        b_db += tl.sum(b_dvb * b_y, axis=1)
        tl.store(dv2 + tile_v + i_v, (b_dvb * b_beta[:, None]).to(dv2.dtype.element_ty), mask=m_tk)

    # the gradient through the WY inverse: only the strictly lower part of A is a function of the inputs
    m_A = (o_t[:, None] > o_t[None, :]) & m_tk & m_t[None, :]
    b_dA = tl.where(m_A, b_dA * b_beta[None, :], 0.0)
    b_dA = tl.dot(b_dA.to(b_At.dtype), b_At, out_dtype=ACC)
    b_dA = tl.dot(b_At, b_dA.to(b_At.dtype), out_dtype=ACC)
    b_dA = tl.where(m_A, -b_dA, 0.0)
    tl.store(dA + o_t[:, None] * (H * BT) + o_a[None, :], b_dA.to(dA.dtype.element_ty), mask=m_tk)
    tl.store(db + o_t * H, b_db.to(db.dtype.element_ty), mask=m_t)


def chunk_kda_bwd_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, cu_seqlens=None, chunk_indices=None):
    """(dq, dk, dv2, db, dg, dA) as fla's chunk_kda_bwd_wy_dqkg_fused returns them (fp32 but dv2, in v's dtype;
    float64 inputs give float64). Layouts: q, k, g [B, T, H, K]; v, v_new, do, dv [B, T, H, V]; beta [B, T, H];
    A [B, T, H, 64]; h, dh [B, NT, H, K, V] (copied where not contiguous); K and V powers of two >= 16 (the
    caller's verifier checks: k3.ops.kda_fla_backend). Varlen (fla's layout): B = 1, cu_seqlens [N + 1] the
    sequences' token offsets, chunk_indices [NT, 2] each chunk's (sequence, chunk within it), h and dh a row per
    chunk in that order; chunks do not cross sequences."""
    q, k, v, v_new, g, beta, A, h, do, dh, dv = (x.contiguous() for x in (q, k, v, v_new, g, beta, A, h, do, dh, dv))
    B, T, H, K = k.shape
    V = v.shape[-1]
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1 or chunk_indices is None:
            raise ValueError(f"varlen needs B = 1 (got {B}) and chunk_indices (got {chunk_indices is not None})")
        cu_seqlens, chunk_indices = cu_seqlens.contiguous(), chunk_indices.contiguous()
    NT = chunk_indices.shape[0] if varlen else triton.cdiv(T, CHUNK)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc = tl.float64 if wide == torch.float64 else tl.float32
    dq = torch.empty(B, T, H, K, dtype=wide, device=q.device)
    dk = torch.empty_like(dq)
    dg = torch.empty_like(dq)
    dv2 = torch.empty_like(v)
    db = torch.empty(B, T, H, dtype=wide, device=q.device)
    dA = torch.empty(B, T, H, CHUNK, dtype=wide, device=q.device)
    bk, bv = min(DQKG_BK, K), min(DQKG_BV, V)
    layout = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, IS_VARLEN=varlen)
    with on_device(q):
        _dqkg_kernel[(K // bk, NT, B * H)](q, k, v_new, g, beta, A, h, do, dh, dv, dq, dk, dg, scale, T, H=H, K=K,
                                            V=V, BT=CHUNK, BK=bk, BV=bv, ACC=acc, **layout, num_warps=DQKG_WARPS,
                                            num_stages=DQKG_STAGES, maxnreg=DQKG_MAXNREG if K <= 128 else None)
        _dv_dA_kernel[(NT, B * H)](k, v, g, beta, A, h, dv, dv2, db, dA, T, H=H, K=K, V=V, BT=CHUNK,
                                   BV=min(DVA_BV, V), ACC=acc, **layout, num_warps=DVA_WARPS, num_stages=DVA_STAGES,
                                   maxnreg=DVA_MAXNREG if K <= 128 else None)  # kg [BT, 256] needs more
    return dq, dk, dv2, db, dg, dA


# chunk_kda_bwd_intra: sub-chunks of INTRA_BC rows; K split into programs of INTRA_BK columns. Two forms:
# - "walk" (`_intra_kernel`): a program per (K block, chunk, head) walks the chunk's sub-chunks. Compiled for
#   sm_90: 168 registers, no spills, 3 programs an SM; on the H200 (session 18) 2196 us against fla's 1556. Its
#   SASS (benchmarks/sass_kda_bwd.py) says why: 1712 instructions a thread a sub-chunk at 4 warps, of which the
#   diagonal's fp32 "ieee" dots are ~280 FFMA and ~260 shared loads, and 38 barriers a sub-chunk (the layout
#   changes of four warps sharing [16, 32] tiles); each sub-chunk also forms two [64, BK] factor tiles (exp2 of
#   the whole chunk, masked), 4x the exponentials and dot work the pairs of sub-chunks need.
# - "sub" (`_intra_sub_kernel`): a program per (K block and sub-chunk, chunk, head), as fla's grid, that visits
#   only the sub-chunk pairs it needs: a [BC, BK] factor tile a pair, BC x BC dots. The default: on the H200
#   (session 19, bench_gpu_kernels.py --kda-bwd intra, 8x4096) 1383 us at BK 32, one warp, bf16x3 diagonals,
#   against fla's 1432 and the walk's 2163 (ieee) and the sub form's 1846 at 4 warps, 1443 at 2.
# INTRA_EARLY ("sub" only): read the given dq, dk, dg before the sums (more bytes in flight, more registers).
# INTRA_DIAG: the diagonal blocks' dot precision for fp32 ("ieee": fp32 FMAs; "bf16x3" as fla on Triton >= 3.6:
# three bf16 tensor-core products, ~16 mantissa bits; "tf32x3" likewise).
INTRA_FORM, INTRA_BC, INTRA_BK, INTRA_WARPS, INTRA_STAGES, INTRA_MAXNREG, INTRA_DIAG, INTRA_EARLY = \
    "sub", 16, 32, 1, 2, None, "bf16x3", False


@triton.jit
def _intra_kernel(q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, db_part, dg2, T,
                  H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                  ACC: tl.constexpr, DIAG_PRECISION: tl.constexpr):
    """One program per (K block, chunk, head), a sub-chunk of BC rows at a time: the rows' own side of both score
    matrices (dq, and dk's Akk-row part and db) and their column side (dk's part as a key), each split into the
    sub-chunks before (or after) it, anchored at the sub-chunk's first (or last) row so that every factor
    2^(g_i - g_j) is formed as two factors <= 1, and the diagonal sub-chunk anchored at its middle row (factors up
    to 2^(BC/2 * 7.2) under fla's safe gate, decays >= e^-5 a token)."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    n_rows = tl.num_programs(2) // H  # B
    bos = (i_b * T).to(tl.int64)
    # pointers moved to this row and head once: the offsets below are int32 (a row's T x H x K < 2^31, verifier)
    rows = bos * (H * K) + i_h * K
    q, k, g, dq, dk, dg, dq2, dk2, dg2 = q + rows, k + rows, g + rows, dq + rows, dk + rows, dg + rows, dq2 + rows, \
        dk2 + rows, dg2 + rows
    dAqk, dAkk = dAqk + bos * (H * BT) + i_h * BT, dAkk + bos * (H * BT) + i_h * BT
    beta += bos * H + i_h
    db_part += (i_k * n_rows * T + bos) * H + i_h
    t0 = i_t * BT
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    o_a = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    rows_k = o_t[:, None] * (H * K) + o_k[None, :]
    for i_c in range(0, BT // BC):
        s = t0 + i_c * BC
        if s < T:
            # the whole chunk's q, k, g again each sub-chunk (L1 hits): held across the loop they cost registers
            b_k = tl.load(k + rows_k, mask=m_t[:, None], other=0.0).to(ACC)
            b_g = tl.load(g + rows_k, mask=m_t[:, None], other=0.0).to(ACC)
            o_r = s + o_c
            m_r = o_r < T
            last = tl.minimum(s + BC, T) - 1
            rows_r = o_r[:, None] * (H * K) + o_k[None, :]
            b_qr = tl.load(q + rows_r, mask=m_r[:, None], other=0.0).to(ACC)
            b_kr = tl.load(k + rows_r, mask=m_r[:, None], other=0.0).to(ACC)
            b_gr = tl.load(g + rows_r, mask=m_r[:, None], other=0.0).to(ACC)
            b_br = tl.load(beta + o_r * H, mask=m_r, other=0.0).to(ACC)
            g_row = g + o_k
            b_first = tl.load(g_row + s * (H * K)).to(ACC)
            b_last = tl.load(g_row + last * (H * K)).to(ACC)
            b_mid = tl.load(g_row + tl.minimum(s + BC // 2, last) * (H * K)).to(ACC)

            # rows' side, earlier sub-chunks: Σ_j dA_ij k_j 2^(first - g_j), then x 2^(g_i - first)
            m_before = (o_t < s)[:, None]
            b_kx = tl.where(m_before, b_k * tl.exp2(tl.where(m_before, b_first[None, :] - b_g, 0.0)), 0.0)
            rows_a = o_r[:, None] * (H * BT) + o_a[None, :]
            m_rows = m_r[:, None] & (o_a[None, :] < i_c * BC)
            b_dAq = tl.load(dAqk + rows_a, mask=m_rows, other=0.0).to(ACC)
            b_dAk = tl.load(dAkk + rows_a, mask=m_rows, other=0.0).to(ACC)
            b_e = tl.exp2(tl.where(m_r[:, None], b_gr - b_first[None, :], 0.0))
            b_dq = tl.dot(b_dAq, b_kx.to(b_dAq.dtype), out_dtype=ACC) * b_e
            b_dkr = tl.dot(b_dAk, b_kx.to(b_dAk.dtype), out_dtype=ACC) * b_e

            # columns' side, later sub-chunks: Σ_i dA_ij (q_i, β_i k_i) 2^(g_i - last), then x 2^(last - g_j)
            m_after = (o_t > last) & m_t
            b_ex = tl.exp2(tl.where(m_after[:, None], b_g - b_last[None, :], 0.0))
            b_qx = tl.where(m_after[:, None], tl.load(q + rows_k, mask=m_t[:, None], other=0.0).to(ACC) * b_ex, 0.0)
            b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(ACC)
            b_kbx = tl.where(m_after[:, None], b_k * b_b[:, None] * b_ex, 0.0)
            cols = o_t[None, :] * (H * BT) + i_c * BC + o_c[:, None]  # [BC, BT]: dA^T
            m_cols = m_after[None, :] & (o_c[:, None] < BC)
            b_dAq_t = tl.load(dAqk + cols, mask=m_cols, other=0.0).to(ACC)
            b_dAk_t = tl.load(dAkk + cols, mask=m_cols, other=0.0).to(ACC)
            b_dkc = tl.dot(b_dAq_t, b_qx.to(b_dAq_t.dtype), out_dtype=ACC)
            b_dkc = tl.dot(b_dAk_t, b_kbx.to(b_dAk_t.dtype), b_dkc, out_dtype=ACC)
            b_dkc *= tl.exp2(tl.where(m_r[:, None], b_last[None, :] - b_gr, 0.0))

            # the diagonal sub-chunk, both sides, anchored at its middle row
            b_up = tl.exp2(tl.where(m_r[:, None], b_gr - b_mid[None, :], 0.0))
            b_down = tl.exp2(tl.where(m_r[:, None], b_mid[None, :] - b_gr, 0.0))
            diag = o_r[:, None] * (H * BT) + i_c * BC + o_c[None, :]
            m_valid = m_r[:, None] & m_r[None, :]
            b_dAq_d = tl.load(dAqk + diag, mask=m_valid & (o_c[:, None] >= o_c[None, :]), other=0.0).to(ACC)
            b_dAk_d = tl.load(dAkk + diag, mask=m_valid & (o_c[:, None] > o_c[None, :]), other=0.0).to(ACC)
            b_kd = b_kr * b_down
            b_dq += tl.dot(b_dAq_d, b_kd, input_precision=DIAG_PRECISION, out_dtype=ACC) * b_up
            b_dkr += tl.dot(b_dAk_d, b_kd, input_precision=DIAG_PRECISION, out_dtype=ACC) * b_up
            b_dkc += (tl.dot(tl.trans(b_dAq_d), b_qr * b_up, input_precision=DIAG_PRECISION, out_dtype=ACC)
                      + tl.dot(tl.trans(b_dAk_d), b_kr * b_br[:, None] * b_up, input_precision=DIAG_PRECISION,
                               out_dtype=ACC)) * b_down

            m_rk = m_r[:, None]
            tl.store(dq2 + rows_r, (tl.load(dq + rows_r, mask=m_rk, other=0.0) + b_dq).to(dq2.dtype.element_ty),
                     mask=m_rk)
            b_dkb = b_dkr * b_br[:, None]
            tl.store(dk2 + rows_r, (tl.load(dk + rows_r, mask=m_rk, other=0.0) + b_dkb + b_dkc)
                     .to(dk2.dtype.element_ty), mask=m_rk)
            b_dgr = tl.load(dg + rows_r, mask=m_rk, other=0.0) + b_qr * b_dq + (b_dkb - b_dkc) * b_kr
            tl.store(dg2 + rows_r, b_dgr.to(dg2.dtype.element_ty), mask=m_rk)
            # db: this K block's share (the blocks' shares and the given db summed after the launch)
            tl.store(db_part + o_r * H,
                     tl.sum(b_dkr * b_kr, axis=1).to(db_part.dtype.element_ty), mask=m_r)


@triton.jit
def _intra_sub_kernel(q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, db_part, dg2, T,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      ACC: tl.constexpr, DIAG_PRECISION: tl.constexpr, EARLY: tl.constexpr):
    """`_intra_kernel`'s sums, one program per (K block and sub-chunk, chunk, head): the sub-chunk's rows take
    each earlier sub-chunk J as one BC x BC dot of the keys anchored at the rows' first row (k_j 2^(first - g_j)
    <= 1, then x 2^(g_i - first) <= 1), the diagonal block anchored at its middle row, and, as keys, each later
    sub-chunk J's queries and beta-scaled keys anchored at the rows' last row (2^(g_i - last) <= 1, then
    x 2^(last - g_j) <= 1). One [BC, BK] exponential tile a pair: no masked whole-chunk tiles."""
    NC: tl.constexpr = BT // BC
    i_kc, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_i = i_kc // NC, i_kc % NC
    i_b, i_h = i_bh // H, i_bh % H
    n_rows = tl.num_programs(2) // H  # B
    t0 = i_t * BT
    s = t0 + i_i * BC
    if s < T:
        bos = (i_b * T).to(tl.int64)
        # pointers moved to this row and head once: int32 offsets below (as _intra_kernel)
        rows = bos * (H * K) + i_h * K
        q, k, g, dq, dk, dg, dq2, dk2, dg2 = q + rows, k + rows, g + rows, dq + rows, dk + rows, dg + rows, \
            dq2 + rows, dk2 + rows, dg2 + rows
        dAqk, dAkk = dAqk + bos * (H * BT) + i_h * BT, dAkk + bos * (H * BT) + i_h * BT
        beta += bos * H + i_h
        db_part += (i_k * n_rows * T + bos) * H + i_h
        o_c = tl.arange(0, BC)
        o_k = i_k * BK + tl.arange(0, BK)
        o_r = s + o_c
        m_r = o_r < T
        m_rk = m_r[:, None]
        rows_r = o_r[:, None] * (H * K) + o_k[None, :]
        rows_a = o_r[:, None] * (H * BT) + o_c[None, :]  # [BC, BC] of dA: this sub-chunk's rows, a J's columns
        last = tl.minimum(s + BC, T) - 1
        g_row = g + o_k
        b_first = tl.load(g_row + s * (H * K)).to(ACC)
        b_last = tl.load(g_row + last * (H * K)).to(ACC)
        b_mid = tl.load(g_row + tl.minimum(s + BC // 2, last) * (H * K)).to(ACC)
        b_gr = tl.load(g + rows_r, mask=m_rk, other=0.0).to(ACC)
        if EARLY:  # the given gradients' reads (first touches of memory) overlap the sums below; costs registers
            b_dq0 = tl.load(dq + rows_r, mask=m_rk, other=0.0)
            b_dk0 = tl.load(dk + rows_r, mask=m_rk, other=0.0)
            b_dg0 = tl.load(dg + rows_r, mask=m_rk, other=0.0)

        # rows' side, earlier sub-chunks (whole: they lie before row s < T)
        b_dq = tl.zeros([BC, BK], dtype=ACC)
        b_dkr = tl.zeros([BC, BK], dtype=ACC)
        for j in range(0, NC):
            if j < i_i:
                tile_j = (t0 + j * BC + o_c)[:, None] * (H * K) + o_k[None, :]
                b_kx = tl.load(k + tile_j).to(ACC) * tl.exp2(b_first[None, :] - tl.load(g + tile_j).to(ACC))
                b_dAq = tl.load(dAqk + rows_a + j * BC, mask=m_rk, other=0.0).to(ACC)
                b_dAk = tl.load(dAkk + rows_a + j * BC, mask=m_rk, other=0.0).to(ACC)
                b_dq = tl.dot(b_dAq, b_kx, b_dq, out_dtype=ACC)
                b_dkr = tl.dot(b_dAk, b_kx, b_dkr, out_dtype=ACC)
        b_e = tl.exp2(tl.where(m_rk, b_gr - b_first[None, :], 0.0))
        b_dq *= b_e
        b_dkr *= b_e

        # the diagonal block, both sides, anchored at its middle row
        b_up = tl.exp2(tl.where(m_rk, b_gr - b_mid[None, :], 0.0))
        b_down = tl.exp2(tl.where(m_rk, b_mid[None, :] - b_gr, 0.0))
        m_valid = m_rk & m_r[None, :]
        b_dAq_d = tl.load(dAqk + rows_a + i_i * BC, mask=m_valid & (o_c[:, None] >= o_c[None, :]), other=0.0)
        b_dAk_d = tl.load(dAkk + rows_a + i_i * BC, mask=m_valid & (o_c[:, None] > o_c[None, :]), other=0.0)
        b_dAq_d, b_dAk_d = b_dAq_d.to(ACC), b_dAk_d.to(ACC)
        b_kr = tl.load(k + rows_r, mask=m_rk, other=0.0).to(ACC)
        b_kd = b_kr * b_down
        b_dq += tl.dot(b_dAq_d, b_kd, input_precision=DIAG_PRECISION, out_dtype=ACC) * b_up
        b_dkr += tl.dot(b_dAk_d, b_kd, input_precision=DIAG_PRECISION, out_dtype=ACC) * b_up
        b_qr = tl.load(q + rows_r, mask=m_rk, other=0.0).to(ACC)
        b_br = tl.load(beta + o_r * H, mask=m_r, other=0.0).to(ACC)
        b_dkc = (tl.dot(tl.trans(b_dAq_d), b_qr * b_up, input_precision=DIAG_PRECISION, out_dtype=ACC)
                 + tl.dot(tl.trans(b_dAk_d), b_kr * b_br[:, None] * b_up, input_precision=DIAG_PRECISION,
                          out_dtype=ACC)) * b_down

        # columns' side, later sub-chunks: Σ_i dA_ij (q_i, β_i k_i) 2^(g_i - last), then x 2^(last - g_j)
        b_dkl = tl.zeros([BC, BK], dtype=ACC)
        for j in range(0, NC):
            if (j > i_i) & (t0 + j * BC < T):
                o_j = t0 + j * BC + o_c
                m_j = o_j < T
                tile_j = o_j[:, None] * (H * K) + o_k[None, :]
                b_ex = tl.exp2(tl.where(m_j[:, None], tl.load(g + tile_j, mask=m_j[:, None], other=0.0).to(ACC)
                                        - b_last[None, :], 0.0))
                b_qx = tl.load(q + tile_j, mask=m_j[:, None], other=0.0).to(ACC) * b_ex
                b_bj = tl.load(beta + o_j * H, mask=m_j, other=0.0).to(ACC)
                b_kbx = tl.load(k + tile_j, mask=m_j[:, None], other=0.0).to(ACC) * (b_bj[:, None] * b_ex)
                cols = o_j[None, :] * (H * BT) + i_i * BC + o_c[:, None]  # [BC, BC]: dA[J rows, our columns]^T
                b_dAq_t = tl.load(dAqk + cols, mask=m_j[None, :], other=0.0).to(ACC)
                b_dAk_t = tl.load(dAkk + cols, mask=m_j[None, :], other=0.0).to(ACC)
                b_dkl = tl.dot(b_dAq_t, b_qx, b_dkl, out_dtype=ACC)
                b_dkl = tl.dot(b_dAk_t, b_kbx, b_dkl, out_dtype=ACC)
        b_dkc += b_dkl * tl.exp2(tl.where(m_rk, b_last[None, :] - b_gr, 0.0))

        if not EARLY:
            b_dq0 = tl.load(dq + rows_r, mask=m_rk, other=0.0)
            b_dk0 = tl.load(dk + rows_r, mask=m_rk, other=0.0)
            b_dg0 = tl.load(dg + rows_r, mask=m_rk, other=0.0)
        tl.store(dq2 + rows_r, (b_dq0 + b_dq).to(dq2.dtype.element_ty), mask=m_rk)
        b_dkb = b_dkr * b_br[:, None]
        tl.store(dk2 + rows_r, (b_dk0 + b_dkb + b_dkc).to(dk2.dtype.element_ty), mask=m_rk)
        b_dgr = b_dg0 + b_qr * b_dq + (b_dkb - b_dkc) * b_kr
        tl.store(dg2 + rows_r, b_dgr.to(dg2.dtype.element_ty), mask=m_rk)
        tl.store(db_part + o_r * H, tl.sum(b_dkr * b_kr, axis=1).to(db_part.dtype.element_ty), mask=m_r)


def chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg):
    """(dq, dk, db, dg) with the intra-chunk parts added, as fla's chunk_kda_bwd_intra returns them (new tensors:
    dq, dk in dq's and dk's dtype, db, dg fp32; float64 in, float64 out). Layouts: q, k, g, dq, dk, dg [B, T, H, K];
    beta, db [B, T, H]; dAqk, dAkk [B, T, H, 64]. Gates must satisfy fla's safe-gate bound (a token's decay
    >= e^-5; the caller's verifier checks safe_gate and lower_bound)."""
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg = (x.contiguous() for x in (q, k, g, beta, dAqk, dAkk, dq, dk, db, dg))
    B, T, H, K = k.shape
    NT = triton.cdiv(T, CHUNK)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    acc = tl.float64 if wide == torch.float64 else tl.float32
    bk = min(INTRA_BK, K)
    dq2, dk2 = torch.empty_like(dq), torch.empty_like(dk)
    dg2 = torch.empty_like(dg, dtype=wide)
    db_part = torch.empty(K // bk, B, T, H, dtype=wide, device=q.device)
    sub = INTRA_FORM == "sub"
    kernel, grid, form = (_intra_sub_kernel, (K // bk * (CHUNK // INTRA_BC), NT, B * H), dict(EARLY=INTRA_EARLY)) \
        if sub else (_intra_kernel, (K // bk, NT, B * H), {})
    with on_device(q):
        kernel[grid](q, k, g, beta, dAqk, dAkk, dq, dk, dg, dq2, dk2, db_part, dg2, T, H=H, K=K, BT=CHUNK,
                     BC=INTRA_BC, BK=bk, ACC=acc, DIAG_PRECISION=INTRA_DIAG if acc == tl.float32 else None,
                     num_warps=INTRA_WARPS, num_stages=INTRA_STAGES, maxnreg=INTRA_MAXNREG, **form)
    return dq2, dk2, db_part.sum(0) + db, dg2
