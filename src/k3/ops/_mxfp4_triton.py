"""Triton kernels for routed experts stored as packed MXFP4 (imported only through k3.ops.triton_dispatch; needs
triton). Hopper has no FP4 tensor cores, so each program dequantises its weight tile in registers (two E2M1
codes a byte, the even column in the low nibble, one E8M0 scale per 32 input columns: SPEC §4) and feeds it to
`tl.dot` in bf16 (fp32 inputs keep fp32, IEEE). In bf16 the low and high nibbles stay two separate half-tiles,
met by the activations' even and odd columns (split in registers), and an inline-PTX routine makes two bf16
weights from a nibble pair in ~3.5 instructions a weight (`_E2M1_BF16X2_ASM`). Weights given as
`DecodeLayoutWeight` (bytes rearranged once at load, k3.ops.mxfp4_layout) take `_DECODE_WORD_ASM` instead: a
rotate, a mask and one multiply a pair, ~1.6 a weight. Under the CPU interpreter (no PTX) both layouts decode
in plain Triton and the dots run in fp32.

Operand order (W_LEFT): the dequantised weights as the dot's right operand (written to shared memory in their
own layout) measured faster on the H200 than as the left one (a few-row decode tile then fills the tensor
cores' wide side with weights, but the registers' dot layout pulls a shuffle through shared memory in
front of the dequantisation): `tile_config` picks the right operand for bf16.

One kernel, two schedules; neither reads anything on the host, so both can be captured in a CUDA graph:
* grouped (prefill, big batches): rows sorted by expert, `counts` per expert on the device; a tile is BLOCK_M
  rows of one expert, from `tile_schedule`, which sizes the grid by an upper bound on the tile count;
* selected (decode): tile t is slot t = (token t // k, choice t % k), expert idx[t]: one row, no sort, and only
  the selected experts' bytes are read; idx[t] < 0 (a slot another expert-parallel rank holds) reads nothing
  and gives a zero row.
GLU: the gate (w1) and up (w3) tiles of the same rows in one program, SiTU-GLU in the epilogue.
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_rows_l2
from k3.ops._situ_triton import _situ_glu
from k3.ops.mxfp4_layout import DecodeLayoutWeight

# Under PDL (K3_PDL, k3.ops._pdl_triton) a decode (selected) program prefetches its packed rows' first
# PREFETCH_STEPS K blocks into L2 before the wait, then keeps that many blocks ahead of its loads.
PREFETCH_STEPS = 4


@triton.jit
def _dequant_tile(p, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes p [BLOCK_N, BLOCK_K/2] and scale bytes s [BLOCK_N, BLOCK_K/32] → float32 [BLOCK_N, BLOCK_K]
    (the exact path, for fp32 and fp16 inputs: fp32 arithmetic, columns in order)."""
    c = tl.interleave(p & 0xF, p >> 4).to(tl.uint32)  # the even column is the low nibble
    mag = c & 7  # 0..7 → {0, .5, 1, 1.5, 2, 3, 4, 6}; from 2 on: exponent (mag >> 1) - 1, mantissa bit mag & 1
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    v = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    sb = s.to(tl.uint32)
    # 2^(s - 127) from exponent bits; byte 0 is 2^-127, below float32's normals: mantissa bit 22
    scale = tl.where(sb == 0, 1 << 22, sb << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


# bf16 pairs from 4 packed bytes b0..b3 (one register) and their 4 scales (bf16, two registers): $0, $1 = the
# low nibbles' values (b0, b1), (b2, b3); $2, $3 = the high nibbles'. Each code's sign bit goes to bf16 bit 15
# and its 3 magnitude bits to bits 6..8 (exponent low bits and the top mantissa bit): that bf16 is the E2M1
# value times 2^-126, exactly (magnitude 1, the value 0.5, is a bf16 subnormal), so one bf16x2 multiply by
# 2^126 gives the value and a second by the scale gives the weight, both exact. About 3.5 instructions a weight
# (the generic form, with selects and a float32 round trip, took ~14: decode was bound by them).
_E2M1_BF16X2_ASM = tl.constexpr("""
{
.reg .b32 z, t01, t23, a, b, big;
mov.b32 z, 0;
mov.b32 big, 0x7E807E80;
prmt.b32 t01, $4, z, 0x4140;
prmt.b32 t23, $4, z, 0x4342;
shl.b32 a, t01, 6;
shl.b32 b, t01, 12;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 a, a, big;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, t23, 6;
shl.b32 b, t23, 12;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 a, a, big;
mul.rn.bf16x2 $1, a, $6;
shl.b32 a, t01, 2;
shl.b32 b, t01, 8;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 a, a, big;
mul.rn.bf16x2 $2, a, $5;
shl.b32 a, t23, 2;
shl.b32 b, t23, 8;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 a, a, big;
mul.rn.bf16x2 $3, a, $6;
}
""")


@triton.jit
def _dequant_halves_bf16(p, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes p [BLOCK_N, BLOCK_K/2], scale bytes s [BLOCK_N, BLOCK_K/32] → (even columns, odd columns),
    each bf16 [BLOCK_N, BLOCK_K/2]: the low and the high nibbles, never interleaved (the activations are split
    the same way instead)."""
    sb = s.to(tl.uint16)
    scale = tl.where(sb == 0, 0x0040, sb << 7).to(tl.bfloat16, bitcast=True)  # 2^(s-127); byte 0 subnormal
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    return tl.inline_asm_elementwise(_E2M1_BF16X2_ASM, "=r,=r,=r,=r,r,r,r", [p, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


# bf16 pairs from one word of the decode layout (k3.ops.mxfp4_layout: $4, 4 packed bytes = 8 columns) and the
# word's factor 2^(s - 1 - B) as bf16x2 ($5): $0 = columns (0, 2), $1 = (4, 6), $2 = (1, 3), $3 = (5, 7). The
# load-time bit permutation leaves each pair's sign and magnitude bits one rotation away from their bf16 places
# (pair 3: two rotations), so a pair costs a rotate, a mask and one multiply that applies 2^126 and the scale at
# once: 13 instructions for 8 weights (the released layout's `_E2M1_BF16X2_ASM` takes 30).
_DECODE_WORD_ASM = tl.constexpr("""
{
.reg .b32 t, u;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
shf.r.wrap.b32 t, $4, $4, 6;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $5;
shf.r.wrap.b32 t, $4, $4, 12;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
shf.r.wrap.b32 t, $4, $4, 2;
shf.r.wrap.b32 u, $4, $4, 10;
and.b32 t, t, 0x01000100;
and.b32 u, u, 0x80C080C0;
or.b32 t, t, u;
mul.rn.bf16x2 $3, t, $5;
}
""")


@triton.jit
def _pow2(E: tl.constexpr):
    """2^E as float32 for an integer 0 <= E <= 126."""
    return tl.full((), 2.0 ** E, tl.float32)


@triton.jit
def _rotr(w, r: tl.constexpr):
    return (w >> r) | (w << (32 - r))


@triton.jit
def _pair_codes(t):
    """bf16x2 bits with each code's sign at bit 15 (31) and magnitude at 6-8 (22-24) → the two E2M1 codes."""
    lo = ((t >> 6) & 7) | ((t >> 12) & 8)
    hi = ((t >> 22) & 7) | ((t >> 28) & 8)
    return lo, hi


@triton.jit
def _e2m1_value(c):
    """E2M1 codes (uint32) → float32 values, exactly (the integer construction of `_dequant_tile`)."""
    mag = c & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _decode_words_reference(p, s, BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode layout in plain Triton, the same rotations and masks as `_DECODE_WORD_ASM` (for fp32 inputs,
    and for the CPU interpreter, which runs no PTX): p [BLOCK_N, BLOCK_K/2] decode-layout bytes, s [BLOCK_N,
    BLOCK_K/32] → (even columns, odd columns) as float32 [BLOCK_N, BLOCK_K/2], times 2^(s - 127 - BIAS)."""
    b = tl.reshape(p, (BLOCK_N, BLOCK_K // 8, 4)).to(tl.uint32)
    b0, b1 = tl.split(tl.reshape(b, (BLOCK_N, BLOCK_K // 8, 2, 2)))  # bytes (0, 2), (1, 3)
    w0, w2 = tl.split(b0)
    w1, w3 = tl.split(b1)
    w = w0 | (w1 << 8) | (w2 << 16) | (w3 << 24)
    c0, c2 = _pair_codes(w & 0x81C081C0)
    c4, c6 = _pair_codes(_rotr(w, 6) & 0x81C081C0)
    c1, c3 = _pair_codes(_rotr(w, 12) & 0x81C081C0)
    c5, c7 = _pair_codes((_rotr(w, 2) & 0x01000100) | (_rotr(w, 10) & 0x80C080C0))
    even = tl.reshape(tl.join(tl.join(c0, c4), tl.join(c2, c6)), (BLOCK_N, BLOCK_K // 2))  # c0, c2, c4, c6
    odd = tl.reshape(tl.join(tl.join(c1, c5), tl.join(c3, c7)), (BLOCK_N, BLOCK_K // 2))
    e = s.to(tl.int32) - BIAS  # 2^(e - 127) from float32 bits: exponent field e, or a subnormal below 1
    scale = tl.where(e > 0, e << 23, tl.where(e > -23, 1 << (22 + e), 0)).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    return _e2m1_value(even) * scale, _e2m1_value(odd) * scale


@triton.jit
def _decode_words_bf16(p, s, BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode layout by `_DECODE_WORD_ASM`: p [BLOCK_N, BLOCK_K/2] decode-layout bytes, s [BLOCK_N,
    BLOCK_K/32] → (even columns, odd columns), bf16 [BLOCK_N, BLOCK_K/2], times 2^-BIAS. Each asm call takes 4
    consecutive bytes of a thread, which are one word: the bf16 dot operand's layout (kWidth 4) gives every
    thread aligned runs of 4 bytes along K (the CUDA tests would see any other grouping). BIAS is a constexpr
    (0 but for scales past 2^1): a runtime scalar here keeps Triton from decoding in the dot operand's layout,
    and the dequantised tile then takes a trip through shared memory."""
    f = (s.to(tl.uint32) + (126 - BIAS)) * 0x00800080  # 2^(s - 1 - BIAS) in both halves of a bf16x2
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    return tl.inline_asm_elementwise(_DECODE_WORD_ASM, "=r,=r,=r,=r,r,r,r,r,r", [p, f],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _released_halves_reference(p, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The released layout's even and odd columns as float32 [BLOCK_N, BLOCK_K/2] in plain Triton (the CPU
    interpreter's stand-in for `_E2M1_BF16X2_ASM`)."""
    e = s.to(tl.int32)
    scale = tl.where(e > 0, e << 23, 1 << 22).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    q = p.to(tl.uint32)
    return _e2m1_value(q & 0xF) * scale, _e2m1_value(q >> 4) * scale


@triton.jit
def _accumulate(acc, w_p, w_s, w_off, s_off, kp, kb, p_mask, s_mask, xt, xe, xo, BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr, W_LEFT: tl.constexpr,
                DECODE_LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    """acc + this K block's products: W x^T [BLOCK_N, BLOCK_M] when W_LEFT, else x W^T [BLOCK_M, BLOCK_N]."""
    if MASKED:
        p = tl.load(w_p + w_off + kp[None, :], mask=p_mask, other=0)
        s = tl.load(w_s + s_off + kb[None, :], mask=s_mask, other=127)
    else:  # whole tiles (K3's shapes): no predicates, and no select of the masked scales' stand-in per word
        p = tl.load(w_p + w_off + kp[None, :])
        s = tl.load(w_s + s_off + kb[None, :])
    if EXACT and not DECODE_LAYOUT:
        w = _dequant_tile(p, s, BLOCK_N, BLOCK_K)
        if W_LEFT:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(xt), tl.trans(w), acc, input_precision="ieee")
    else:
        if DECODE_LAYOUT and USE_ASM and not EXACT:
            even, odd = _decode_words_bf16(p, s, BIAS, BLOCK_N, BLOCK_K)
        elif DECODE_LAYOUT:
            even, odd = _decode_words_reference(p, s, BIAS, BLOCK_N, BLOCK_K)
        elif USE_ASM:
            even, odd = _dequant_halves_bf16(p, s, BLOCK_N, BLOCK_K)
        else:
            even, odd = _released_halves_reference(p, s, BLOCK_N, BLOCK_K)
        if not EXACT:  # bf16 weights (exact but for overflow); the interpreter's bf16 dot is wrong: fp32 there
            even, odd = even.to(tl.bfloat16), odd.to(tl.bfloat16)
            if not USE_ASM:
                even, odd = even.to(tl.float32), odd.to(tl.float32)
        precision: tl.constexpr = "tf32" if USE_ASM and not EXACT else "ieee"
        if W_LEFT:
            acc = tl.dot(even, xe, acc, input_precision=precision)
            acc = tl.dot(odd, xo, acc, input_precision=precision)
        else:  # the weights as the right operand: they go to shared memory as dequantised, in their own layout
            acc = tl.dot(xe, tl.trans(even), acc, input_precision=precision)
            acc = tl.dot(xo, tl.trans(odd), acc, input_precision=precision)
    return acc


@triton.jit
def _expert_gemm_kernel(x_ptr, wa_p, wa_s, wb_p, wb_s, y_ptr, sched_ptr, num_tiles_ptr, TOP_K,
                        beta_gate, beta_up, N: tl.constexpr, K: tl.constexpr,
                        SELECTED: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EXACT: tl.constexpr, W_LEFT: tl.constexpr,
                        DECODE_LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, BIAS_A: tl.constexpr,
                        BIAS_B: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                        E: tl.constexpr = 0, PF_STEPS: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    if PREFETCH:  # (selected only) the packed bytes of this slot's expert's rows, PF_STEPS K blocks of them: the
        # expert id is read before the wait for this alone (the router wrote it kernels before; a stale one costs a
        # useless prefetch, an id outside [0, E) none) and again after it
        pf_e = tl.load(sched_ptr + t).to(tl.int64)
        pf_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        pf_ok = (pf_n < N) & (pf_e >= 0) & (pf_e < E)
        pf_rows = (tl.where(pf_ok, pf_e, 0) * N + pf_n) * (K // 2)
        prefetch_rows_l2(wa_p + pf_rows, pf_ok, tl.minimum(PF_STEPS * BLOCK_K, K) // 2, 1)
        if GLU:
            prefetch_rows_l2(wb_p + pf_rows, pf_ok, tl.minimum(PF_STEPS * BLOCK_K, K) // 2, 1)
    pdl_enter(PDL)
    if SELECTED:  # slot t: token t // TOP_K's row, expert sched[t], output row t
        e = tl.load(sched_ptr + t).to(tl.int64)
        x_row, y_row, n_rows = t // TOP_K, t, 1
    else:  # sched: [3, max_tiles] = expert, first row, rows of each tile; tiles past the count do nothing
        if t >= tl.load(num_tiles_ptr):
            return
        e = tl.load(sched_ptr + t).to(tl.int64)
        x_row = tl.load(sched_ptr + tl.num_programs(1) + t)
        y_row = x_row
        n_rows = tl.load(sched_ptr + 2 * tl.num_programs(1) + t)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < n_rows
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if SELECTED:
        if e < 0:  # a slot another expert-parallel rank holds: no weight byte read, no GEMM
            if not GLU:  # the down launch leaves a zero row for the routing weights' sum (gate/up: nothing)
                tl.store(y_ptr + y_row.to(tl.int64) * N + n, tl.zeros((BLOCK_N,), y_ptr.dtype.element_ty),
                         mask=n_ok)
            return
    kh, ks = K // 2, K // 32
    w_off = e * N * kh + n[:, None].to(tl.int64) * kh
    s_off = e * N * ks + n[:, None].to(tl.int64) * ks
    x_rows = x_ptr + (x_row + m[None, :]).to(tl.int64) * K
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if W_LEFT else (BLOCK_M, BLOCK_N)
    MASKED: tl.constexpr = N % BLOCK_N != 0 or K % BLOCK_K != 0  # else every weight tile is whole
    acc_a = tl.zeros(acc_shape, dtype=tl.float32)
    acc_b = tl.zeros(acc_shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH and (k0 // BLOCK_K) % PF_STEPS == 0:  # every PF_STEPS blocks, the next PF_STEPS ahead
            ahead = (k0 + PF_STEPS * BLOCK_K) // 2
            pf_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_at = (e * N + pf_n) * kh + ahead
            prefetch_rows_l2(wa_p + rows_at, pf_n < N, tl.minimum(PF_STEPS * BLOCK_K // 2, kh - ahead), 1)
            if GLU:
                prefetch_rows_l2(wb_p + rows_at, pf_n < N, tl.minimum(PF_STEPS * BLOCK_K // 2, kh - ahead), 1)
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        p_mask = n_ok[:, None] & (kp[None, :] < kh)
        s_mask = n_ok[:, None] & (kb[None, :] < ks)
        if EXACT and not DECODE_LAYOUT:  # x^T [BLOCK_K, BLOCK_M] in column order
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & (kk[:, None] < K), other=0.0).to(tl.float32)
            xe, xo = xt, xt
        else:  # x^T's even and odd columns, [BLOCK_K/2, BLOCK_M] each, to meet the low and high nibbles; loaded
            # as whole rows (vector loads) and split in registers: strided loads cost an instruction an element
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(tl.trans(x_rows) + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
            if EXACT or not USE_ASM:  # fp32, or the CPU interpreter (whose bf16 dot is wrong)
                x = x.to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            if W_LEFT:
                xe, xo = tl.trans(xe), tl.trans(xo)
            xt = xe
        acc_a = _accumulate(acc_a, wa_p, wa_s, w_off, s_off, kp, kb, p_mask, s_mask, xt, xe, xo, BIAS_A, BLOCK_N,
                            BLOCK_K, EXACT, W_LEFT, DECODE_LAYOUT, USE_ASM, MASKED)
        if GLU:
            acc_b = _accumulate(acc_b, wb_p, wb_s, w_off, s_off, kp, kb, p_mask, s_mask, xt, xe, xo, BIAS_B,
                                BLOCK_N, BLOCK_K, EXACT, W_LEFT, DECODE_LAYOUT, USE_ASM, MASKED)
    if BIAS_A:  # the factors left out 2^BIAS (k3.ops.mxfp4_layout.scale_bias; 0 unless scales pass 2^1)
        acc_a = acc_a * _pow2(BIAS_A)
    if GLU and BIAS_B:
        acc_b = acc_b * _pow2(BIAS_B)
    out = acc_a
    if GLU:
        out = _situ_glu(acc_a, acc_b, beta_gate, beta_up, EXACT)
    if W_LEFT:
        tl.store(y_ptr + (y_row + m[None, :]).to(tl.int64) * N + n[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(y_ptr + (y_row + m[:, None]).to(tl.int64) * N + n[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def tile_schedule(counts: torch.Tensor, block_m: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of at most block_m rows, none spanning two experts, from per-expert row counts on the device (no
    host sync). Returns (sched int32 [3, max_tiles]: expert, first row, rows; num_tiles int32 [1])."""
    counts = counts.to(torch.int32)
    tiles = (counts + (block_m - 1)) // block_m
    tiles_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    rows_end = torch.cumsum(counts, 0, dtype=torch.int32)
    t = torch.arange(max_tiles, dtype=torch.int32, device=counts.device)
    e = torch.searchsorted(tiles_end, t, right=True).clamp_(max=counts.numel() - 1).to(torch.int32)
    first = rows_end[e] - counts[e] + (t - (tiles_end[e] - tiles[e])) * block_m
    rows = (rows_end[e] - first).clamp_(0, block_m)
    return torch.stack((e, first, rows)), tiles_end[-1:]


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on Σ_e ceil(counts[e] / block_m) for any counts summing to num_rows: each expert that has
    rows adds at most one partial tile."""
    return triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)


def _launch(x, w_a, w_b, out, sched, num_tiles, tiles, top_k, selected, betas, config):
    block_m, block_n, block_k, num_warps, num_stages, w_left, *limit = config
    options = {"maxnreg": limit[0]} if limit and limit[0] else {}  # a register cap: more CTAs an SM (sweeps)
    glu = w_b is not None
    w_b = w_b if glu else w_a
    decode_layout = isinstance(w_a, DecodeLayoutWeight)
    if decode_layout != isinstance(w_b, DecodeLayoutWeight):
        raise TypeError("the gate and up weights must share one layout (released pairs or DecodeLayoutWeight)")
    E, N, kh = w_a[0].shape
    exact = x.dtype != torch.bfloat16  # fp32 (and fp16, whose range cannot hold every weight) stay fp32
    # the bf16 factors 2^(s - 1 - bias) need the bias; fp32 weights hold every scale as they are
    bias_a, bias_b = (w_a.bias, w_b.bias) if decode_layout and not exact else (0, 0)
    grid = (triton.cdiv(N, block_n), tiles)
    launch = pdl.launch(x)
    # (one row of packed bytes a thread: a tile's rows are its threads at 4 warps; more rows just repeat)
    prefetch = selected and pdl.prefetching(launch, x, w_a[0], w_b[0])
    _expert_gemm_kernel[grid](x, w_a[0], w_a[1], w_b[0], w_b[1], out, sched, num_tiles, top_k,
                              float(betas[0]), float(betas[1]), N=N, K=2 * kh, SELECTED=selected,
                              GLU=glu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EXACT=exact,
                              W_LEFT=w_left, DECODE_LAYOUT=decode_layout, USE_ASM=x.is_cuda, BIAS_A=bias_a,
                              BIAS_B=bias_b, num_warps=num_warps, num_stages=num_stages, **options, **launch,
                              PREFETCH=prefetch, E=E, PF_STEPS=PREFETCH_STEPS)


def tile_config(rows_per_tile: int, x: torch.Tensor, k: int = 0,
                selected: bool = False) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, W_LEFT) for a launch whose reduction is k wide: a
    few-row tile for decode-like loads, 64-row tiles for prefill; fp32 inputs take smaller tiles (twice the
    registers per element); `selected`: decode's launch per selected expert. W_LEFT: the weight tile is the dot's
    left operand (fills the tensor cores' wide side at decode), else the right one."""
    block_m = 16 if rows_per_tile <= 16 else (32 if rows_per_tile <= 32 else 64)
    if x.dtype != torch.bfloat16:
        return block_m, 32, 64, 4, 2, True
    # from the H200 sweep (benchmarks/bench_mxfp4_gemm.py --sweep, RESULTS.md): the weights as the right operand
    # (stored to shared memory as dequantised) beat the left one (converted through shared memory in registers'
    # dot layout) at every shape: 0.177 against 0.253 ms at decode T=1, 215 against 176 TFLOP/s at prefill
    if block_m == 64:
        return 64, 128, 64, 4, 4, False
    # 16-row tiles read K 256 wide where that divides it (else the masked loop): T=64 grouped 3.98 against 4.51 ms
    # on the H200 (session 18), 4.39 against 5.72 on an H100 (session 30); T=1 graphed a tie on the H200 (0.137),
    # 0.145 against 0.166 ms on the H100. 32-row tiles at 256 were never timed.
    block_k = 256 if block_m == 16 and k > 0 and k % 256 == 0 else 128
    # the selected experts' launch at 64 columns a tile (twice the programs over the same bytes): T=1 graphed
    # 0.126 against 0.155 ms, T=8 0.835 against 0.929 on an H100 (session 32); the grouped launch keeps 128
    # (T=64 4.51 against 4.36 ms)
    block_n = 64 if selected and block_m == 16 else 128
    return block_m, block_n, block_k, 4, 3, False


def launch_configs(rows_per_tile: int, x: torch.Tensor, L: int, I: int,
                   selected: bool = False) -> tuple[tuple, tuple]:
    """(gate-and-up config, down config): `tile_config` for reductions L and I wide."""
    return tile_config(rows_per_tile, x, L, selected), tile_config(rows_per_tile, x, I, selected)


def _per_launch(config) -> tuple[tuple, tuple]:
    """(gate-and-up config, down config) from one tile config or a pair of them."""
    return (config[0], config[1]) if isinstance(config[0], tuple) else (config, config)


def grouped_situ_mlp(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, beta_gate: float, beta_up: float,
                     rows_hint: int | None = None, config=None) -> torch.Tensor:
    """Rows of x [S, L] sorted by expert, counts [E] on the device; w1, w3, w2: (packed, scale) pairs in the
    checkpoint layout ([E, I, L/2] + [E, I, L/32]; [E, L, I/2] + [E, L, I/32]). Returns [S, L] in x's dtype.
    rows_hint: the expected rows per expert (chooses the tile height; the default assumes a balanced load);
    config: `tile_config`'s tuple, to override it (benchmarks): one for both launches, or a pair (gate and up,
    down) with the same BLOCK_M; a 7th entry caps the registers a thread (maxnreg)."""
    S, L = x.shape
    E, I = w1[0].shape[:2]
    x = x.contiguous()
    out = x.new_empty(S, L)
    if S == 0:
        return out
    up, down = _per_launch(config or launch_configs(rows_hint or -(-S // E), x, L, I))
    if up[0] != down[0]:
        raise ValueError(f"the two launches share one tile schedule: BLOCK_M {up[0]} and {down[0]} differ")
    tiles = max_tiles(S, E, up[0])
    sched, num_tiles = tile_schedule(counts, up[0], tiles)
    h = x.new_empty(S, I)
    betas = (beta_gate, beta_up)
    _launch(x, w1, w3, h, sched, num_tiles, tiles, 1, False, betas, up)
    _launch(h, w2, None, out, sched, num_tiles, tiles, 1, False, betas, down)
    return out


def selected_situ_mlp(z: torch.Tensor, idx: torch.Tensor, w1, w3, w2, beta_gate: float,
                      beta_up: float, config=None) -> torch.Tensor:
    """Decode: y[n·k + j] = W2_e SiTU(W1_e z[n], W3_e z[n]) with e = idx[n, j], each slot reading its expert's
    packed bytes in place (e < 0: a zero row, no work). z: [N, L]; idx: [N, k]. Returns the per-slot outputs
    [N·k, L] in z's dtype."""
    N, k = idx.shape
    E, I = w1[0].shape[:2]
    L = z.shape[1]
    z, flat = z.contiguous(), idx.reshape(-1).to(torch.int32)
    up, down = _per_launch(config or launch_configs(1, z, L, I, selected=True))
    h = z.new_empty(N * k, I)
    y = z.new_empty(N * k, L)
    betas = (beta_gate, beta_up)
    _launch(z, w1, w3, h, flat, flat, N * k, k, True, betas, up)
    _launch(h, w2, None, y, flat, flat, N * k, 1, True, betas, down)
    return y
