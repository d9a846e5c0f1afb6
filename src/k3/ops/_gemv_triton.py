"""Triton GEMV / skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]ᵀ (+ bias) (+ residual), M ≤ 64 rows.
Imported only through k3.ops.triton_dispatch (needs triton); the contract, the reference and the selector are
`k3.ops.gemv`.

At decode the linears are weight-bound: every byte of W is read once and each weight meets only M rows, so the
kernel's job is to keep enough loads in flight to fill the card. W is read as nn.Linear stores it ([N, K],
K contiguous) in tiles of BLOCK_N rows by BLOCK_K columns. Program (n block, k split) sums its tiles in fp32
registers:
- few rows (M ≤ DOT_MIN_ROWS, or fp32 weights): products on the FMA units, a [BLOCK_M, BLOCK_N, BLOCK_K] tile
  reduced along K (exact fp32 products of the stored values);
- more rows with 16-bit weights: `tl.dot` on x padded to 16 rows (tensor cores, fp32 accumulation), as 8 or 16
  rows of FMA work would take longer than the weight's bytes; past 16 rows (a batch of 32 or 64), x padded to 32
  or 64 rows against wider tiles of W (each program reloads x from L2 for its block of N: 64 rows of W a block
  keep those loads at the weight's own bytes).
When N alone gives too few programs to fill the SMs (o_proj's 1536 rows in 16-row tiles: 96 programs for 132
SMs), K is split as well: each split writes its fp32 partial sums to a workspace and draws an atomic ticket for
its block of N; the block's last split to finish adds the splits and applies the epilogue, and sets the ticket back
to zero (k3.ops.triton_dispatch.ticket_workspace; as k3.ops._router_triton). No second launch; the splits are
summed in a fixed order (the ticket says only who sums), so a result is the same on every run. Epilogue: + bias, + residual (the call site's add after the GEMM), in fp32, one rounding to
the output dtype.
An RMSNorm before the linear can come along (`norm_weight`): W·(g ⊙ x·r) = r · W·(g ⊙ x) with
r = rsqrt(mean(x²) + eps) one number a row, so the K loop multiplies x by g as it loads it and the program that
applies the epilogue scales the row by r, which it takes from one more pass over the row of x (K values: the weight
is N times more).
A SiTU-GLU before the linear can come along too (`glu_up`): x is then the gate, and the K loop loads the up values
beside it and takes SiTU-GLU(gate, up) (k3.ops._situ_triton's functions), rounded to x's dtype as the reference's h.
So can a sigmoid output gate (`out_gate`, MLA's o ⊙ σ(gate) before o_proj): the K loop loads the gate beside x.
Two linears into one output (`decode_gemv_pair`: the MoE's shared-expert down projection with its GLU and the
routed up projection with its norm) are one grid: each program walks the first segment, then the second, and
scales the second's sums by their rows' rstd before it adds them (one launch for two); where K is split, its
splits walk either segment and the last split of a block scales only the second's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._math_triton import _sigmoid
from k3.ops._pdl_triton import pdl_enter, prefetch_rows_l2
from k3.ops._situ_triton import _situ_glu
from k3.ops.triton_dispatch import inference_op, on_device, sm_count, ticket_workspace

# Rows from which 16-bit weights go through tl.dot (x padded to 16 rows); below it the FMA units. A first guess.
DOT_MIN_ROWS = 4
# Launch shapes, names so a sweep can time others (benchmarks/bench_gpu_kernels.py --gemv-sweep).
# fma: rows of W per program and the element budget of one [M, N, K] product tile (its registers): 4 rows of W
# (H100, session 38, `--gemv-sweep --gemv-rows 1,4`, µs at one row: o_proj 3.7 where 8 rows took 5.3 and cuBLAS
# 5.4, KDA's stacked projections [6288, 1536] 9.2 where 10.7 and 10.0, the MoE's [2816, 1536] 5.6 where 6.7 and
# 6.2; at 4 rows o_proj 6.8 where 9.6; 2 rows of W within 5% of 4). The element budget stays 8192: at 4 rows
# 32768 (a 2048-wide K tile) took o_proj to 5.5 and the MoE's to 8.3 (cuBLAS 5.4, 6.2), its registers unchecked.
# dot: the tile of W per step; stages: the loads in flight of the pipelined K loop. programs_per_sm: the grid
# aimed at before K is split.
# wide: the dot tile of W past 16 rows: 32 rows of W (H100, session 35, `--gemv-sweep --gemv-rows 64`: KDA's
# stacked projections, [6284, 1536] as then timed, 12.1 µs where 64 rows of W took 16.0 and 128 took 35.2;
# o_proj [1536, 1536] 8.8 where 9.6; it doubles the programs of a launch, the lack sass_gemv.py pointed at).
# norm: the row norm's columns a pass, at most norm_tile_elems elements of x a pass (its registers).
LAUNCH = dict(fma_block_n=4, fma_tile_elems=8192, fma_warps=4, fma_stages=2, dot_block_n=16, dot_block_k=256,
              dot_warps=4, dot_stages=3, wide_block_n=32, wide_block_k=128, wide_warps=4, programs_per_sm=2,
              min_split_k=256, norm_block=1024, norm_tile_elems=16384)
# SMs assumed off the GPU (the Triton interpreter on CPU tensors): the H200's, so the CPU tests plan the
# same grids as the card.
_INTERPRETER_SMS = 132


@triton.jit
def _row_rstd(x_ptr, rows, M, K, stride_xm, eps, NORM_K: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """rsqrt(mean(x[row]²) + eps) in fp32 for each of `rows` (masked past M), over K columns in NORM_BLOCK tiles
    (NORM_K: K rounded up to them, a constant bound the interpreter can run)."""
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    ss = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for k0 in tl.range(0, NORM_K, NORM_BLOCK):
        ks = k0 + tl.arange(0, NORM_BLOCK)
        x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _epilogue(acc, bias_ptr, res_ptr, out_ptr, rows, cols, M, N, stride_rm, stride_om,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """acc [rows, cols] fp32 (+ bias[cols]) (+ residual[rows, cols]) stored once in the output's dtype."""
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tile_sums(x_ptr, w_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, K, k_start, stride_xm,
               stride_wn, stride_um, HAS_NORM: tl.constexpr, HAS_GLU: tl.constexpr, GLU_EXACT: tl.constexpr,
               OUT_GATE: tl.constexpr, USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The fp32 sums [BLOCK_M, BLOCK_N] of x's `rows` times W's `cols` over the K_SPLIT columns from k_start (cut
    at K), x taken through its prologue (GLU, output gate or g ⊙ x) as it is loaded."""
    m_ok = rows < M
    n_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    up_rows = up_ptr + rows.to(tl.int64)[:, None] * stride_um
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # constant bounds: a software-pipelined loop on the GPU, and what the interpreter (the CPU tests) can run
    for k0 in tl.range(0, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if HAS_GLU:  # x is the gate: h = SiTU-GLU(gate, up), rounded to x's dtype as situ_glu's h
            gate = x.to(tl.float32)
            up = tl.load(up_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = _situ_glu(gate, up, beta_gate, beta_up, GLU_EXACT).to(x_ptr.dtype.element_ty)
        if OUT_GATE:  # x ⊙ σ(gate) (the gate read where glu_up would be), rounded to x's dtype as the reference's
            g = tl.load(up_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * _sigmoid(g, GLU_EXACT)).to(x_ptr.dtype.element_ty)
        if HAS_NORM:  # g ⊙ x in fp32 (the row's rstd comes in the epilogue); rounded as x for the tensor cores
            g = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if USE_DOT and not DOT_IN_FP32:
                x = (x.to(tl.float32) * g[None, :]).to(x_ptr.dtype.element_ty)
            else:
                x = x.to(tl.float32) * g[None, :]
        # off the GPU the dot's 16-bit tiles go in as fp32: the interpreter (triton 3.6) multiplies bf16 tiles as
        # their raw uint16 bits. The products are exact either way and the sums fp32.
        if USE_DOT and DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _prefetch_w(w_ptr, cols, N, K, k_start, stride_wn, K_SPLIT: tl.constexpr, CHUNKS: tl.constexpr):
    """Into L2 (PDL's step 1, k3.ops._pdl_triton): rows `cols` of W over the K_SPLIT columns from k_start."""
    prefetch_rows_l2(w_ptr + cols.to(tl.int64) * stride_wn + k_start, cols < N, tl.minimum(K_SPLIT, K - k_start),
                     CHUNKS)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, tickets_ptr, norm_w_ptr, eps, up_ptr, beta_gate, beta_up,
                 M, N, K, stride_xm, stride_wn, stride_rm, stride_om, stride_um,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, HAS_GLU: tl.constexpr,
                 GLU_EXACT: tl.constexpr, SPLIT: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, NORM_K: tl.constexpr,
                 NORM_BLOCK: tl.constexpr, OUT_GATE: tl.constexpr = False, PDL: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, PF_CHUNKS: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    if PREFETCH:
        _prefetch_w(w_ptr, cols, N, K, pid_k * K_SPLIT, stride_wn, K_SPLIT, PF_CHUNKS)
    pdl_enter(PDL)
    # this split's K_SPLIT columns (a whole number of tiles; the last split is cut at K)
    acc = _tile_sums(x_ptr, w_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, K, pid_k * K_SPLIT,
                     stride_xm, stride_wn, stride_um, HAS_NORM, HAS_GLU, GLU_EXACT, OUT_GATE, USE_DOT, DOT_IN_FP32,
                     BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, NUM_STAGES)
    if SPLIT:  # this split's partial sums; the block's last split adds them all and applies the epilogue
        if _last_split(acc, part_ptr, tickets_ptr, pid_n, pid_k, rows, cols, M, N):
            acc = _sum_splits(part_ptr, rows, cols, M, N, 0, x_ptr, K, stride_xm, eps, HAS_NORM, NORM_K, NORM_BLOCK)
            _epilogue(acc, bias_ptr, res_ptr, out_ptr, rows, cols, M, N, stride_rm, stride_om, HAS_BIAS, HAS_RES)
            tl.store(tickets_ptr + pid_n, 0)
    else:
        if HAS_NORM:
            acc = acc * _row_rstd(x_ptr, rows, M, K, stride_xm, eps, NORM_K, NORM_BLOCK)[:, None]
        _epilogue(acc, bias_ptr, res_ptr, out_ptr, rows, cols, M, N, stride_rm, stride_om, HAS_BIAS, HAS_RES)


@triton.jit
def _last_split(acc, part_ptr, tickets_ptr, pid_n, pid_k, rows, cols, M, N):
    """Stores split pid_k's partial sums of block pid_n and draws the block's ticket: whether this is its last
    split to finish (which then sums them all and sets the ticket back to zero)."""
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(part_ptr + (pid_k * M + rows[:, None]) * N + cols[None, :], acc, mask=ok)
    # every thread's stores precede the ticket (the barrier); the ticket releases them to the program that draws
    # the last one (its acquire)
    tl.debug_barrier()
    return tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(1) - 1


@triton.jit
def _sum_splits(part_ptr, rows, cols, M, N, norm_from, x_ptr, K, stride_xm, eps, HAS_NORM: tl.constexpr,
                NORM_K: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """Σ_s part[s, rows, cols] over the grid's splits in order, those from `norm_from` on (a pair's second
    segment) times their rows' rstd of x where HAS_NORM."""
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    plain = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)  # the splits before norm_from
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    s = 0
    while s < tl.num_programs(1):
        # .cg: from L2, where the other programs' stores are; never a stale line of this SM's L1
        v = tl.load(part_ptr + (s * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        plain += tl.where(s < norm_from, v, 0.0)
        acc += tl.where(s < norm_from, 0.0, v)
        s += 1
    if HAS_NORM:
        acc = acc * _row_rstd(x_ptr, rows, M, K, stride_xm, eps, NORM_K, NORM_BLOCK)[:, None]
    return acc + plain


@triton.jit
def _gemv_pair_kernel(a_ptr, wa_ptr, up_ptr, beta_gate, beta_up, b_ptr, wb_ptr, norm_w_ptr, eps, part_ptr, tickets_ptr,
                      out_ptr,
                      M, N, KA, KB, splits_a, stride_am, stride_wan, stride_um, stride_bm, stride_wbn, stride_om,
                      A_GLU: tl.constexpr, B_NORM: tl.constexpr, GLU_EXACT: tl.constexpr, SPLIT: tl.constexpr,
                      USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, K_SPLIT_A: tl.constexpr, K_SPLIT_B: tl.constexpr,
                      NUM_STAGES: tl.constexpr, NORM_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, PF_CHUNKS: tl.constexpr = 1):
    """Two K segments into one output: a (through its GLU) by W_a plus b (g ⊙ b, times its rows' rstd) by W_b.
    Unsplit, each program walks both segments whole and stores the sum (one launch for the two linears); SPLIT,
    splits 0..splits_a-1 walk a, the rest b, each stores its partial sums, and the last split of a block to finish
    adds them, b's scaled by the rstd (`_last_split`, `_sum_splits`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:  # the slices of W_a and W_b this program reads
        if not SPLIT or pid_k < splits_a:
            _prefetch_w(wa_ptr, cols, N, KA, pid_k * K_SPLIT_A, stride_wan, K_SPLIT_A, PF_CHUNKS)
        if not SPLIT or pid_k >= splits_a:
            _prefetch_w(wb_ptr, cols, N, KB, (pid_k - splits_a) * K_SPLIT_B if SPLIT else 0, stride_wbn, K_SPLIT_B,
                        PF_CHUNKS)
    pdl_enter(PDL)
    if SPLIT:
        if pid_k < splits_a:
            acc = _tile_sums(a_ptr, wa_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, KA,
                             pid_k * K_SPLIT_A, stride_am, stride_wan, stride_um, False, A_GLU, GLU_EXACT, False,
                             USE_DOT, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT_A, NUM_STAGES)
        else:
            acc = _tile_sums(b_ptr, wb_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, KB,
                             (pid_k - splits_a) * K_SPLIT_B, stride_bm, stride_wbn, stride_um, B_NORM, False,
                             GLU_EXACT, False, USE_DOT, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT_B,
                             NUM_STAGES)
        if _last_split(acc, part_ptr, tickets_ptr, pid_n, pid_k, rows, cols, M, N):
            acc = _sum_splits(part_ptr, rows, cols, M, N, splits_a, b_ptr, KB, stride_bm, eps, B_NORM, NORM_K,
                              NORM_BLOCK)
            _epilogue(acc, out_ptr, out_ptr, out_ptr, rows, cols, M, N, stride_om, stride_om, False, False)
            tl.store(tickets_ptr + pid_n, 0)
    else:
        acc = _tile_sums(a_ptr, wa_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, KA, 0,
                         stride_am, stride_wan, stride_um, False, A_GLU, GLU_EXACT, False, USE_DOT, DOT_IN_FP32,
                         BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT_A, NUM_STAGES)
        acc_b = _tile_sums(b_ptr, wb_ptr, norm_w_ptr, up_ptr, beta_gate, beta_up, rows, cols, M, N, KB, 0,
                           stride_bm, stride_wbn, stride_um, B_NORM, False, GLU_EXACT, False, USE_DOT, DOT_IN_FP32,
                           BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT_B, NUM_STAGES)
        if B_NORM:
            acc_b = acc_b * _row_rstd(b_ptr, rows, M, KB, stride_bm, eps, NORM_K, NORM_BLOCK)[:, None]
        _epilogue(acc + acc_b, out_ptr, out_ptr, out_ptr, rows, cols, M, N, stride_om, stride_om, False, False)


def plan(M: int, N: int, K: int, dtype: torch.dtype, sms: int) -> dict:
    """The launch for these shapes: its form (fma, dot: 16 rows, wide: 32 or 64; the LAUNCH entries it reads are
    named by it), the tile, the warps and stages, and how many splits of K (1: none)."""
    use_dot = M > DOT_MIN_ROWS and dtype in (torch.bfloat16, torch.float16)
    if use_dot:  # x padded to 16 rows (tl.dot's least), or to 32 / 64 against the wide tiles of W
        block_m, tile = max(16, triton.next_power_of_2(M)), "wide" if M > 16 else "dot"
        block_n, warps, stages = LAUNCH[f"{tile}_block_n"], LAUNCH[f"{tile}_warps"], LAUNCH["dot_stages"]
        block_k = min(LAUNCH[f"{tile}_block_k"], max(16, triton.next_power_of_2(K)))
    else:
        block_m, block_n = triton.next_power_of_2(M), LAUNCH["fma_block_n"]
        warps, stages = LAUNCH["fma_warps"], LAUNCH["fma_stages"]
        block_k = min(max(16, LAUNCH["fma_tile_elems"] // (block_m * block_n)), max(16, triton.next_power_of_2(K)))
    n_blocks = triton.cdiv(N, block_n)
    want = LAUNCH["programs_per_sm"] * sms
    split = 1
    if n_blocks < want:  # too few programs along N: split K, each split at least min_split_k wide
        split = max(1, min(triton.cdiv(want, n_blocks), K // LAUNCH["min_split_k"]))
    k_per_split = triton.cdiv(triton.cdiv(max(K, 1), split), block_k) * block_k  # whole tiles per split
    split = triton.cdiv(max(K, 1), k_per_split)
    return dict(use_dot=use_dot, form=tile if use_dot else "fma", block_m=block_m, block_n=block_n, block_k=block_k,
                warps=warps, stages=stages, split=split, k_per_split=k_per_split, n_blocks=n_blocks)


def norm_pass(K: int, block_m: int) -> dict:
    """The row norm's passes over K (`_row_rstd`): NORM_BLOCK columns a pass (at most norm_tile_elems elements of
    x's block_m rows), NORM_K = K rounded up to them."""
    block = min(LAUNCH["norm_block"], triton.next_power_of_2(max(K, 1)),
                max(16, LAUNCH["norm_tile_elems"] // block_m))
    return dict(NORM_K=triton.cdiv(max(K, 1), block) * block, NORM_BLOCK=block)


def pair_plan(M: int, N: int, KA: int, KB: int, dtype: torch.dtype, sms: int) -> dict:
    """The launch of two K segments into one output: one tile for both (`plan`'s for the wider); unsplit (one
    launch, each program walking both segments) where `plan` would split neither linear, else each segment split
    on its own (at least once), the splits shared between them by width so that the grid fills the SMs as `plan`
    aims to (still one launch: each block's last split sums them)."""
    p = plan(M, N, max(KA, KB), dtype, sms)
    split = plan(M, N, KA, dtype, sms)["split"] > 1 or plan(M, N, KB, dtype, sms)["split"] > 1
    total = max(2, triton.cdiv(LAUNCH["programs_per_sm"] * sms, p["n_blocks"]))
    out = dict(p, split=split)
    for name, K, share in (("a", KA, KA / (KA + KB)), ("b", KB, KB / (KA + KB))):
        n = max(1, min(round(total * share), K // LAUNCH["min_split_k"])) if split else 1
        k_per_split = triton.cdiv(triton.cdiv(max(K, 1), n), p["block_k"]) * p["block_k"]
        out[f"split_{name}"], out[f"k_per_split_{name}"] = triton.cdiv(max(K, 1), k_per_split), k_per_split
    return out


def _prefetch(launch: dict, p: dict, *weights: torch.Tensor) -> dict:
    """The GEMV's prefetch of its weight slices under PDL (k3.ops._pdl_triton), where they are aligned for it:
    one chunk of a W row a thread."""
    return dict(PREFETCH=pdl.prefetching(launch, weights[0], *weights),
                PF_CHUNKS=max(1, 32 * p["warps"] // p["block_n"]))


@inference_op("decode_gemv")
def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, glu_up: torch.Tensor | None = None,
                beta_gate: float = 0.0, beta_up: float = 0.0, out_gate: torch.Tensor | None = None) -> torch.Tensor:
    """x := SiTU-GLU(x, glu_up; beta_gate, beta_up) when glu_up [M, K] is given, RMSNorm(x; norm_weight,
    norm_eps) when norm_weight is, x ⊙ σ(out_gate) when out_gate [M, K] is (one of them), then x [M, K] (columns
    contiguous) @ weight
    [N, K]ᵀ (+ bias [N]) (+ residual [M, N]) → [M, N] in x's dtype; inputs checked by the caller
    (k3.ops.gemv.linear). A custom op: torch.compile keeps it as one call."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    sms = sm_count(x.device.index) if x.is_cuda else _INTERPRETER_SMS
    p = plan(M, N, K, weight.dtype, sms)
    split = p["split"] > 1
    part = torch.empty(p["split"], M, N, dtype=torch.float32, device=x.device) if split else out
    tickets = ticket_workspace(p["n_blocks"], x.device) if split else out  # (unsplit: an unread stand-in)
    res = residual if residual is not None else out  # (an unread stand-in pointer)
    b = bias if bias is not None else out
    norm_w = norm_weight if norm_weight is not None else out
    up = glu_up if glu_up is not None else out_gate if out_gate is not None else x  # the prologue's second input
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_NORM=norm_weight is not None)
    # (fp32 outputs take the exact exps, as k3.ops._situ_triton's kernels do)
    glu = dict(HAS_GLU=glu_up is not None, GLU_EXACT=x.dtype == torch.float32, OUT_GATE=out_gate is not None)
    norm = norm_pass(K, p["block_m"])
    launch = pdl.launch(x)
    with on_device(x):
        _gemv_kernel[(p["n_blocks"], p["split"])](
            x, weight, b, res, out, part, tickets, norm_w, norm_eps, up, beta_gate, beta_up, M, N, K, x.stride(0),
            weight.stride(0), res.stride(0), out.stride(0), up.stride(0), SPLIT=split, USE_DOT=p["use_dot"],
            DOT_IN_FP32=not x.is_cuda, BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
            K_SPLIT=p["k_per_split"], NUM_STAGES=p["stages"], num_warps=p["warps"], **flags, **norm, **glu,
            **_prefetch(launch, p, weight), **launch)
    return out


@decode_gemv.register_fake
def _(x, weight, bias, residual, norm_weight=None, norm_eps=0.0, glu_up=None, beta_gate=0.0, beta_up=0.0,
      out_gate=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@inference_op("decode_gemv_pair")
def decode_gemv_pair(a: torch.Tensor, weight_a: torch.Tensor, glu_up: torch.Tensor | None, beta_gate: float,
                     beta_up: float, b: torch.Tensor, weight_b: torch.Tensor, norm_weight: torch.Tensor | None,
                     norm_eps: float) -> torch.Tensor:
    """a' @ weight_a [N, KA]ᵀ + b' @ weight_b [N, KB]ᵀ → [M, N] in a's dtype, a' = SiTU-GLU(a, glu_up) when glu_up
    is given (else a), b' = RMSNorm(b; norm_weight, norm_eps) when norm_weight is (else b): two linears into one
    output in one launch (where K is split, the segments' splits, summed by each block's last); inputs checked by the caller
    (k3.ops.gemv.linear_pair)."""
    M, KA = a.shape
    KB, N = b.shape[1], weight_a.shape[0]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    sms = sm_count(a.device.index) if a.is_cuda else _INTERPRETER_SMS
    p = pair_plan(M, N, KA, KB, weight_a.dtype, sms)
    splits = p["split_a"] + p["split_b"] if p["split"] else 1
    part = torch.empty(splits, M, N, dtype=torch.float32, device=a.device) if p["split"] else out
    tickets = ticket_workspace(p["n_blocks"], a.device) if p["split"] else out  # (unsplit: an unread stand-in)
    up = glu_up if glu_up is not None else a  # (an unread stand-in pointer)
    norm_w = norm_weight if norm_weight is not None else out
    norm = norm_pass(KB, p["block_m"])
    launch = pdl.launch(a)
    with on_device(a):
        _gemv_pair_kernel[(p["n_blocks"], splits)](
            a, weight_a, up, beta_gate, beta_up, b, weight_b, norm_w, norm_eps, part, tickets, out, M, N, KA, KB,
            p["split_a"], a.stride(0), weight_a.stride(0), up.stride(0), b.stride(0), weight_b.stride(0),
            out.stride(0), A_GLU=glu_up is not None, B_NORM=norm_weight is not None,
            GLU_EXACT=a.dtype == torch.float32, SPLIT=p["split"], USE_DOT=p["use_dot"], DOT_IN_FP32=not a.is_cuda,
            BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT_A=p["k_per_split_a"],
            K_SPLIT_B=p["k_per_split_b"], NUM_STAGES=p["stages"], num_warps=p["warps"], **norm,
            **_prefetch(launch, p, weight_a, weight_b), **launch)
    return out


@decode_gemv_pair.register_fake
def _(a, weight_a, glu_up, beta_gate, beta_up, b, weight_b, norm_weight, norm_eps):
    return a.new_empty(a.shape[0], weight_a.shape[0])
