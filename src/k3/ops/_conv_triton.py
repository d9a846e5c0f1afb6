"""Triton kernels for the causal depthwise short conv (imported only through k3.ops.triton_dispatch; needs triton).

Same contract and math as `k3.ops.conv.short_conv_reference`: xp = [tail; x] in fp32, y[t] = Σ_j w[j] · xp[t + j],
a tap j of token t used only where the (−1 left-padded) document id of row t − (W−1) + j equals token t's.
Forward: one pass over x in [BLOCK_T, BLOCK_C] tiles; the W − 1 halo rows are re-read per tap (shifted loads
that hit cache) instead of building the fp32 padded copy the torch path needs. Backward (short_conv_bwd_kernel):
one walk down each chunk of rows, every element of x and dy loaded once, each thread holding its channels' last W
rows in registers, so its bytes floor is those two reads and dx's write (3 · B·T·C · 2 bytes in bf16: 302 MB for
`small`'s [8, 4096, 1536]; with the pre-activation read too, 258 µs on an H200 in session 14, where the tiles
kernel it replaced took 458: benchmarks/bench_gpu_kernels.py --backwards).
With `silu=True` the SiLU that KDA applies after the conv runs in the same kernels: forward stores SiLU(y) only;
backward recomputes the pre-activation y from the x rows it holds anyway (W multiply-adds, in the forward's order,
rounded to x's dtype as a stored y would be) and turns dy into dy · SiLU'(y) as it loads it. Keeping y instead
was a write in forward, a read in backward and B·T·C activations held between (session 39: 36 of them a `small`
step, 3.6 GB). The weight gradient's per-chunk partials are summed by the backward kernel's last programs
(`_finish_weight_grad`, deterministic) where torch summed them after it.
With `l2_head` = K as well (KDA's q and k in training) each head of K channels of SiLU(y) is L2-normalised in the
same kernels: whole heads a channel tile, the forward's sums of squares and the backward's two per-head dot
products reductions over a row's tile in registers; fla's own norm kernels were a pass each way over q and over k
(l2norm_fwd 69 µs, l2norm_bwd 132 µs a call at small's 8 x 4096 on an H100, session 41's profile).
"""
import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from k3.ops._math_triton import _sigmoid_pair
from k3.ops.triton_dispatch import on_device

_FWD_BLOCK_T = 32
_MAX_BLOCK_C = 128
_NUM_WARPS = 4
# The rows backward: CHUNK_T rows of BLOCK_C channels a program (two warps: 4 channels a thread), UNROLL rows'
# loads issued together; W − 1 rows of x and dz re-read at each chunk's two ends (from L2). 256 channels and 2
# warps against 128 and 1: 154 against 186 µs on the H200 at small's 8 x 4096 (session 16, --backwards)
BWD_CHUNK_T = 64
BWD_BLOCK_C = 256
BWD_UNROLL = 4
BWD_NUM_WARPS = 2
# Steps of UNROLL rows the backward's loop keeps in flight: 1, each step's loads then its math in turn (a
# program's memory idles through its math: 258 µs, 38% of the bytes floor, on the H200 in session 14); 2, the
# next step's loads issued (cp.async, into shared memory) before this step's math. sm_90, bf16, UNROLL 4:
# 96 registers and 3 KB shared (21 programs an SM) against 123 and none (16). On the H200 (session 15,
# `bench_gpu_kernels.py --backwards`) 2 lost to 1, which stays the default.
BWD_STAGES = 1
# The weight gradient's sum over (batch, chunk) partials, finished in the backward kernel itself (True: the last
# program of each (batch, channel block) to finish sums its batch's chunk partials, and the last of those sums the
# batches into the weight's gradient, in its dtype; each sum in a fixed order, so deterministic) or by torch after
# it (False: a sum over the [B, T/CHUNK_T, W, C] fp32 partials and a cast, two more kernels a call). On the H200
# (session 16, bench_gpu_kernels.py --backwards) True took 186 µs against False's 209.
BWD_FINISH_GW = True
# Grid order: False, chunks of rows on axis 0 (programs launched together walk the same channels of neighbouring
# chunks); True, channel blocks on axis 0 (programs launched together read the neighbouring channels of the same
# rows: whole rows of x, dy and y at once). On the H200 (session 16) True lost: 222 against 186 µs (294 against
# 154 at 256 channels).
BWD_CHANNELS_FIRST = False
# Partials the weight gradient's finish loads at once, every tap of each: a [GW_FINISH_ROWS, MAX_TAPS, BLOCK_C] fp32
# tile (sm_90, the default launch: 4, 8 KB, 124 registers, 16 programs an SM as without the finish; 8 took 138, 14)
GW_FINISH_ROWS = 4
MAX_TAPS = 4  # backward keeps one fp32 weight-gradient accumulator per tap in registers; wider: the torch path
_TAP_SLOTS = tl.constexpr(MAX_TAPS)  # (the kernels' name for it)


@triton.jit
def _offsets(rows, offs_c, C, WIDE: tl.constexpr):
    """rows · C + cols, in int64 when one batch row's T · C can pass 2^31 (WIDE)."""
    if WIDE:
        rows = rows.to(tl.int64)
    return rows[:, None] * C + offs_c[None, :]


@triton.jit
def _tile(ptr, rows, offs_c, n_rows, C, WIDE: tl.constexpr):
    """fp32 [len(rows), BLOCK_C] of a row-major [n_rows, C] block at ptr, zero outside it."""
    ok = ((rows >= 0) & (rows < n_rows))[:, None] & (offs_c < C)[None, :]
    return tl.load(ptr + _offsets(rows, offs_c, C, WIDE), mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _xp_rows(x_b, tail_b, s0, s, offs_c, T, C, W: tl.constexpr, HAS_TAIL: tl.constexpr, WIDE: tl.constexpr):
    """Rows s (starting at s0) of xp = [tail; x] of one batch as fp32 [len(s), BLOCK_C]: x for 0 <= s < T, the tail
    for −(W−1) <= s < 0 (zeros without one), zero elsewhere."""
    v = _tile(x_b, s, offs_c, T, C, WIDE)
    if HAS_TAIL:
        if s0 < 0:  # only a row's first tile reaches into the tail
            v += _tile(tail_b, s + (W - 1), offs_c, W - 1, C, False)
    return v


@triton.jit
def _doc_rows(doc_b, s, T):
    """Document ids of rows s, −1 left of the row (as the reference's padding) and past its end."""
    return tl.load(doc_b + s, mask=(s >= 0) & (s < T), other=-1)


@triton.jit
def _weight(w_ptr, offs_c, C, W: tl.constexpr, j: tl.constexpr):
    """Tap j's weights as a [1, BLOCK_C] row."""
    return tl.load(w_ptr + offs_c * W + j, mask=offs_c < C, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _l2_heads(v, eps, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, K: tl.constexpr):
    """v [ROWS, BLOCK_C] with each run of K channels scaled to unit L2 norm: v / sqrt(Σ v² + eps)."""
    h = tl.reshape(v, [ROWS, BLOCK_C // K, K])
    r = tl.rsqrt(tl.sum(h * h, axis=2) + eps)
    return tl.reshape(h * r[:, :, None], [ROWS, BLOCK_C])


@triton.jit
def _l2_heads_bwd(s, ds, eps, BLOCK_C: tl.constexpr, K: tl.constexpr):
    """The gradient at s [BLOCK_C] (one row) of `_l2_heads(s)` given ds, the gradient at its output, per head:
    (ds − o (o · ds)) / ‖s‖ with o = s / ‖s‖ (‖s‖ with the eps, as the forward)."""
    h = tl.reshape(s, [BLOCK_C // K, K])
    g = tl.reshape(ds, [BLOCK_C // K, K])
    r = tl.rsqrt(tl.sum(h * h, axis=1) + eps)[:, None]
    o = h * r
    return tl.reshape((g - o * tl.sum(o * g, axis=1)[:, None]) * r, [BLOCK_C])


@triton.jit
def short_conv_fwd_kernel(x_ptr, w_ptr, tail_ptr, doc_ptr, y_ptr, new_tail_ptr, T, C, eps,
                          W: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_DOC: tl.constexpr, WIDE: tl.constexpr,
                          SILU: tl.constexpr, L2_HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                          TAIL_ROWS: tl.constexpr):
    pid_t = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)  # per-batch base pointers: in-row offsets are int32 unless WIDE
    x_b, tail_b, doc_b = x_ptr + b * T * C, tail_ptr + b * (W - 1) * C, doc_ptr + b * T
    t0 = pid_t * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    if HAS_DOC:
        doc_t = _doc_rows(doc_b, offs_t, T)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        s = offs_t - (W - 1) + j
        v = _xp_rows(x_b, tail_b, t0 - (W - 1) + j, s, offs_c, T, C, W, HAS_TAIL, WIDE)
        if HAS_DOC:
            v = tl.where((_doc_rows(doc_b, s, T) == doc_t)[:, None], v, 0.0)
        acc += v * _weight(w_ptr, offs_c, C, W, j)
    out_offs = b * T * C + _offsets(offs_t, offs_c, C, WIDE)
    out_mask = (offs_t < T)[:, None] & (offs_c < C)[None, :]
    if SILU:  # y = SiLU(conv) (backward recomputes the conv)
        acc = acc * _sigmoid_pair(acc, False)[0]
    if L2_HEAD:  # each head of L2_HEAD channels (whole heads a tile) L2-normalised
        acc = _l2_heads(acc, eps, BLOCK_T, BLOCK_C, L2_HEAD)
    tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    if pid_t == 0:  # new tail: the last W−1 rows of xp, tail rows included when T < W−1; no document mask
        # (names differ from the tile's: a runtime branch may not rebind a variable with another shape)
        r = tl.arange(0, TAIL_ROWS)
        last_rows = _xp_rows(x_b, tail_b, T - (W - 1), T - (W - 1) + r, offs_c, T, C, W, HAS_TAIL, WIDE)
        tl.store(new_tail_ptr + b * (W - 1) * C + r[:, None] * C + offs_c[None, :], last_rows,
                 mask=(r < W - 1)[:, None] & (offs_c < C)[None, :])


@triton.jit
def _slot(a0, a1, a2, a3, k: tl.constexpr):
    """Slot k of a window of MAX_TAPS rows held as four values (k known at compile time: no select)."""
    if k == 0:
        v = a0
    elif k == 1:
        v = a1
    elif k == 2:
        v = a2
    else:
        v = a3
    return v


@triton.jit
def _zeros(BLOCK_C: tl.constexpr):
    """A fresh fp32 zero vector (a value of its own, not shared with another loop-carried name)."""
    return tl.zeros([BLOCK_C], dtype=tl.float32)


@triton.jit
def _tap_vector(w_ptr, offs_c, C, W: tl.constexpr, j: tl.constexpr):
    """Tap j's weights over the channels (zeros for j >= W)."""
    return tl.load(w_ptr + offs_c * W + j, mask=(offs_c < C) & (j < W), other=0.0).to(tl.float32)


@triton.jit
def short_conv_bwd_kernel(x_ptr, w_ptr, tail_ptr, doc_ptr, gy_ptr, gnt_ptr, gx_ptr, gw_part_ptr,
                          gw_batch_ptr, gw_ptr, count_ptr, gtail_ptr, T, C, eps,
                          W: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_DOC: tl.constexpr, SILU: tl.constexpr,
                          L2_HEAD: tl.constexpr,
                          HAS_GY: tl.constexpr, HAS_GNT: tl.constexpr, NEED_GX: tl.constexpr,
                          NEED_GW: tl.constexpr, NEED_GTAIL: tl.constexpr, CHUNK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
                          FINISH_GW: tl.constexpr, CHANNELS_FIRST: tl.constexpr, FINISH_ROWS: tl.constexpr):
    """One pass down rows t0 − (W−1) .. t0 + CHUNK_T + W − 2 of one batch row for BLOCK_C channels, a row at a
    time, each thread keeping its channels' last MAX_TAPS rows of xp and of dz (the gradient at the conv's
    output: dy, times SiLU'(y) when SILU, y the conv recomputed from the xp rows held) in registers: each element
    of x and dy is loaded and SiLU' taken once. At row t: the weight gradient's products dz[t] · xp[t − (W−1) + j]
    (t in the chunk) and the input gradient of row u = t − (W−1), Σ_j w[j] · dz[t − j] (stored for u in the
    chunk; for u < 0, the tail rows, by program 0). UNROLL rows' loads are issued together, STAGES − 1 steps
    ahead of the math. Partial weight gradients per (batch, chunk) into gw_part; with FINISH_GW their sum too
    (`_finish_weight_grad`: into gw, in its [C, 1, W] layout and dtype). CHANNELS_FIRST: channel blocks on grid
    axis 0, chunks on 1. W <= MAX_TAPS."""
    pid_t = tl.program_id(1 if CHANNELS_FIRST else 0)
    pid_c = tl.program_id(0 if CHANNELS_FIRST else 1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    b = tl.program_id(2).to(tl.int64)
    bTC = b * T * C  # int64 through b (T is a plain int when Triton specialises T == 1)
    x_b, gy_b, gx_b = x_ptr + bTC, gy_ptr + bTC, gx_ptr + bTC
    tail_b, gnt_b, gtail_b = tail_ptr + b * (W - 1) * C, gnt_ptr + b * (W - 1) * C, gtail_ptr + b * (W - 1) * C
    doc_b = doc_ptr + b * T
    t0 = pid_t * CHUNK_T
    w0 = _tap_vector(w_ptr, offs_c, C, W, 0)
    w1 = _tap_vector(w_ptr, offs_c, C, W, 1)
    w2 = _tap_vector(w_ptr, offs_c, C, W, 2)
    w3 = _tap_vector(w_ptr, offs_c, C, W, 3)
    zero = tl.zeros([BLOCK_C], dtype=tl.float32)
    # windows: slot k holds row t − 3 + k (x: xp rows; dz; document ids, −1 outside the row as the reference pads).
    # Every slot starts from a value of its own: Triton carries a name through a loop only where the body leaves
    # it holding another value than it started with, so with one shared starting zero a slot that ends a step
    # holding another slot's starting value (UNROLL < 3: x1 = the x3 it found) is not carried and reads that
    # zero on every step (UNROLL 2 gave rel_err 0.35 on the H200; the interpreter carries every name)
    x0, x1, x2, x3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    d0, d1, d2, d3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    if HAS_DOC:
        id0 = tl.full([], -1, doc_ptr.dtype.element_ty)
        id1 = tl.full([], -1, doc_ptr.dtype.element_ty)
        id2 = tl.full([], -1, doc_ptr.dtype.element_ty)
        id3 = tl.full([], -1, doc_ptr.dtype.element_ty)
    g0, g1, g2, g3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)  # the sums per tap
    first = t0 - (W - 1)
    # STAGES 2: Triton's pipeliner copies the next UNROLL rows (into shared memory) while this step's math runs
    for step in tl.range(0, CHUNK_T + 2 * (W - 1), UNROLL, num_stages=STAGES):
        xs = ()
        gys = ()
        ids = ()
        for k in tl.static_range(UNROLL):  # every load of the UNROLL rows first
            t = first + step + k
            row = t.to(tl.int64) * C + offs_c
            # xp rows past the chunk: no tap of the chunk's rows needs them; SILU's recomputed y of the W − 1 dz
            # rows past it does
            x_ok = c_ok & (t >= 0) & (t < T) & (t < t0 + CHUNK_T + (W - 1 if SILU else 0))
            xv = tl.load(x_b + row, mask=x_ok, other=0.0)
            if HAS_TAIL:
                xv = xv.to(tl.float32) + tl.load(tail_b + (t + W - 1) * C + offs_c, mask=c_ok & (t < 0) & (t >= 1 - W),
                                                 other=0.0).to(tl.float32)
            xs = xs + (xv,)
            # dz rows before the chunk, or W − 1 and more past it: no output row of the chunk reads them
            dz_ok = c_ok & (t >= t0) & (t < T) & (t < t0 + CHUNK_T + W - 1)
            if HAS_GY:
                gys = gys + (tl.load(gy_b + row, mask=dz_ok, other=0.0),)
            if HAS_DOC:
                ids = ids + (tl.load(doc_b + t, mask=(t >= 0) & (t < T), other=-1),)
        for k in tl.static_range(UNROLL):
            t = first + step + k
            x0, x1, x2, x3 = x1, x2, x3, xs[k].to(tl.float32)
            if HAS_DOC:
                id0, id1, id2, id3 = id1, id2, id3, ids[k]
            dz = zero
            if HAS_GY:
                dz = gys[k].to(tl.float32)
                if SILU:  # row t's conv, as the forward summed it (tap order, document mask), in x's dtype
                    z = zero
                    for j in tl.static_range(W):
                        xj = _slot(x0, x1, x2, x3, 4 - W + j)
                        if HAS_DOC:
                            xj = tl.where(_slot(id0, id1, id2, id3, 4 - W + j) == id3, xj, 0.0)
                        z += xj * _slot(w0, w1, w2, w3, j)
                    if L2_HEAD:  # dy is the gradient at the heads' norm: through it first, at s = SiLU(z) as
                        # the forward normalised it (z unrounded: the forward stores neither z nor s)
                        sig, sig_neg = _sigmoid_pair(z, False)
                        dz = _l2_heads_bwd(z * sig, dz, eps, BLOCK_C, L2_HEAD)
                    else:
                        z = z.to(x_ptr.dtype.element_ty).to(tl.float32)
                        sig, sig_neg = _sigmoid_pair(z, False)
                    dz = dz * (sig * (1.0 + z * sig_neg))
            d0, d1, d2, d3 = d1, d2, d3, dz
            if NEED_GW:  # row t's products, for t in the chunk (dz is zero before it)
                gz = tl.where(t < t0 + CHUNK_T, d3, 0.0)
                for j in tl.static_range(W):
                    xj = _slot(x0, x1, x2, x3, 4 - W + j)
                    if HAS_DOC:
                        xj = tl.where(_slot(id0, id1, id2, id3, 4 - W + j) == id3, xj, 0.0)
                    if j == 0:
                        g0 += gz * xj
                    elif j == 1:
                        g1 += gz * xj
                    elif j == 2:
                        g2 += gz * xj
                    else:
                        g3 += gz * xj
            u = t - (W - 1)  # the row whose input gradient is complete: its readers are rows u .. t
            if NEED_GX or NEED_GTAIL:
                gx = zero
                if HAS_GY:
                    for j in tl.static_range(W):  # token t − j reads row u through tap j
                        dj = _slot(d0, d1, d2, d3, 3 - j)
                        if HAS_DOC:
                            dj = tl.where(_slot(id0, id1, id2, id3, 4 - W) == _slot(id0, id1, id2, id3, 3 - j),
                                          dj, 0.0)
                        gx += dj * _slot(w0, w1, w2, w3, j)
                if HAS_GNT:  # xp rows T − (W−1) .. T − 1 are the new tail's rows
                    r = u - (T - (W - 1))
                    gx += tl.load(gnt_b + r * C + offs_c, mask=c_ok & (r >= 0) & (r < W - 1) & (u >= 1 - W),
                                  other=0.0).to(tl.float32)
                if NEED_GX:
                    tl.store(gx_b + u.to(tl.int64) * C + offs_c, gx.to(gx_ptr.dtype.element_ty),
                             mask=c_ok & (u >= t0) & (u < t0 + CHUNK_T) & (u < T))
                if NEED_GTAIL:
                    tl.store(gtail_b + (u + W - 1) * C + offs_c, gx.to(gtail_ptr.dtype.element_ty),
                             mask=c_ok & (pid_t == 0) & (u < 0) & (u >= 1 - W))
    if NEED_GW:
        n_t = tl.num_programs(1 if CHANNELS_FIRST else 0)
        part = gw_part_ptr + (b * n_t + pid_t) * W * C + offs_c
        tl.store(part, g0, mask=c_ok)
        if W > 1:
            tl.store(part + C, g1, mask=c_ok)
        if W > 2:
            tl.store(part + 2 * C, g2, mask=c_ok)
        if W > 3:
            tl.store(part + 3 * C, g3, mask=c_ok)
        if FINISH_GW:
            _finish_weight_grad(gw_part_ptr, gw_batch_ptr, gw_ptr, count_ptr, b, pid_c,
                                tl.num_programs(0 if CHANNELS_FIRST else 1), tl.num_programs(2), n_t, offs_c, C,
                                W, BLOCK_C, FINISH_ROWS)


@triton.jit
def _sum_partials(ptr, n, C, offs_c, W: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """Σ_{i < n} of the fp32 [W, C] blocks at ptr + i · W · C, as [MAX_TAPS, BLOCK_C] (taps past W zero): ROWS
    blocks' taps in one load, summed in index order (the same bits whichever program runs it). The loads skip
    L1 (.cg): other programs wrote these blocks while this one ran."""
    taps = tl.arange(0, _TAP_SLOTS)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([_TAP_SLOTS, BLOCK_C], dtype=tl.float32)
    i = 0
    while i < n:  # (a while: the interpreter cannot range over a run-time count)
        r = (i + rows)[:, None, None]
        ok = (r < n) & (taps < W)[None, :, None] & (offs_c < C)[None, None, :]
        at = (r.to(tl.int64) * W + taps[None, :, None]) * C + offs_c[None, None, :]
        acc += tl.sum(tl.load(ptr + at, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        i += ROWS
    return acc


@triton.jit
def _finish_weight_grad(gw_part_ptr, gw_batch_ptr, gw_ptr, count_ptr, b, pid_c, n_c, B, n_t, offs_c, C,
                        W: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """The weight gradient's sum, after this program stored its (batch b, chunk) partial of channel block pid_c.
    Two tickets (counters zeroed before the launch): the last of batch b's n_t chunk programs of this block to
    arrive sums their partials (chunk order) into gw_batch[b]; the last batch to do so sums gw_batch over the
    batches (batch order) into gw[c, 0, j]. Sums in a fixed order, not in arrival order: deterministic."""
    taps = tl.arange(0, _TAP_SLOTS)[:, None]
    ok = (taps < W) & (offs_c < C)[None, :]
    tl.debug_barrier()  # every thread's partial stored before the ticket releases it
    if tl.atomic_add(count_ptr + b * n_c + pid_c, 1, sem="acq_rel") == n_t - 1:
        batch = _sum_partials(gw_part_ptr + b * n_t * W * C, n_t, C, offs_c, W, BLOCK_C, ROWS)
        tl.store(gw_batch_ptr + (b * W + taps) * C + offs_c[None, :], batch, mask=ok)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + B * n_c + pid_c, 1, sem="acq_rel") == B - 1:
            total = _sum_partials(gw_batch_ptr, B, C, offs_c, W, BLOCK_C, ROWS)
            tl.store(gw_ptr + offs_c[None, :] * W + taps, total.to(gw_ptr.dtype.element_ty), mask=ok)


_WIDE_FROM = 2 ** 31  # T · C from which in-row offsets need int64 (a name, so that tests can lower it)


def _wide(T: int, C: int) -> bool:
    return T * C + C >= _WIDE_FROM  # + C: the halo and masked rows index up to a row past the end


def _block_c(C: int) -> int:
    return min(_MAX_BLOCK_C, max(16, triton.next_power_of_2(C)))


def _tail_rows(W: int) -> int:
    return triton.next_power_of_2(max(W - 1, 1))


L2_EPS = 1e-6  # KDA's q/k L2 norm (k3.ops.norm.l2_norm)


def l2_fusable(K: int) -> bool:
    """Whether the kernels take the heads' L2 norm for heads of K channels: K a power of two that divides both
    passes' channel tiles (whole heads a tile)."""
    return 16 <= K <= BWD_BLOCK_C and K & (K - 1) == 0


class ShortConvTriton(torch.autograd.Function):
    """`short_conv` with both passes in Triton; keeps x (its own dtype), weight, tail and doc_ids for backward
    (with `silu`, backward recomputes the conv's output before the SiLU from them, and with `l2_head` the heads'
    norms from that)."""

    @staticmethod
    def forward(ctx, x, weight, tail, doc_ids, silu, l2_head=None):
        ctx.set_materialize_grads(False)
        B, T, C = x.shape
        W = weight.shape[-1]
        if W > MAX_TAPS:
            raise ValueError(f"short_conv kernels: weight width {W} > MAX_TAPS {MAX_TAPS}")
        if l2_head is not None and not (silu and l2_fusable(l2_head) and C % l2_head == 0):
            raise ValueError(f"short_conv kernels: l2_head {l2_head} needs silu, a power of two in [16, "
                             f"{BWD_BLOCK_C}] and {C} channels a whole number of heads")
        x, weight = x.contiguous(), weight.contiguous()
        tail = None if tail is None else tail.contiguous()
        doc_ids = None if doc_ids is None else doc_ids.contiguous()
        y = torch.empty_like(x)
        new_tail = torch.empty(B, W - 1, C, device=x.device, dtype=torch.float32)
        BLOCK_C = max(_block_c(C), l2_head or 0)  # (whole heads a tile)
        grid = (triton.cdiv(T, _FWD_BLOCK_T), triton.cdiv(C, BLOCK_C), B)
        with on_device(x):
            short_conv_fwd_kernel[grid](
                x, weight, x if tail is None else tail, x if doc_ids is None else doc_ids, y, new_tail, T, C,
                L2_EPS, W=W, HAS_TAIL=tail is not None, HAS_DOC=doc_ids is not None, WIDE=_wide(T, C), SILU=silu,
                L2_HEAD=l2_head or 0, BLOCK_T=_FWD_BLOCK_T, BLOCK_C=BLOCK_C, TAIL_ROWS=_tail_rows(W),
                num_warps=_NUM_WARPS)
        ctx.save_for_backward(x, weight, tail, doc_ids)
        ctx.silu, ctx.l2_head = silu, l2_head or 0
        return y, new_tail

    @staticmethod
    @once_differentiable  # the kernels' gradients are not themselves differentiable
    def backward(ctx, grad_y, grad_new_tail):
        x, weight, tail, doc_ids = ctx.saved_tensors
        need_x, need_w, need_tail = ctx.needs_input_grad[:3]
        need_w = need_w and grad_y is not None  # the new tail does not depend on the weight
        need_tail = need_tail and tail is not None
        if grad_y is None and grad_new_tail is None:
            return None, None, None, None, None, None
        B, T, C = x.shape
        W = weight.shape[-1]
        gy = None if grad_y is None else grad_y.contiguous()
        gnt = None if grad_new_tail is None else grad_new_tail.contiguous()
        gx = torch.empty_like(x) if need_x else None
        gtail = torch.empty_like(tail) if need_tail else None
        n_t, n_c = triton.cdiv(T, BWD_CHUNK_T), triton.cdiv(C, BWD_BLOCK_C)
        finish = need_w and BWD_FINISH_GW
        gw_part = gw_batch = gw = count = None
        if need_w:
            gw_part = torch.empty(B, n_t, W, C, device=x.device, dtype=torch.float32)
        if finish:
            gw_batch = torch.empty(B, W, C, device=x.device, dtype=torch.float32)
            gw = torch.empty_like(weight)
            count = torch.zeros(B * n_c + n_c, device=x.device, dtype=torch.int32)  # the kernel's two tickets
        with on_device(x):
            short_conv_bwd_kernel[(n_c, n_t, B) if BWD_CHANNELS_FIRST else (n_t, n_c, B)](
                x, weight, x if tail is None else tail, x if doc_ids is None else doc_ids,
                x if gy is None else gy, x if gnt is None else gnt,
                x if gx is None else gx, x if gw_part is None else gw_part, x if gw_batch is None else gw_batch,
                x if gw is None else gw, x if count is None else count, x if gtail is None else gtail, T, C,
                L2_EPS, W=W, HAS_TAIL=tail is not None, HAS_DOC=doc_ids is not None, SILU=ctx.silu,
                L2_HEAD=ctx.l2_head,
                HAS_GY=gy is not None, HAS_GNT=gnt is not None, NEED_GX=need_x, NEED_GW=need_w,
                NEED_GTAIL=need_tail, CHUNK_T=BWD_CHUNK_T, BLOCK_C=BWD_BLOCK_C, UNROLL=BWD_UNROLL, STAGES=BWD_STAGES,
                FINISH_GW=finish, CHANNELS_FIRST=BWD_CHANNELS_FIRST, FINISH_ROWS=GW_FINISH_ROWS,
                num_warps=BWD_NUM_WARPS)
        if need_w and not finish:  # the sum by torch: every chunk's partial, in a fixed order, then the cast
            gw = gw_part.sum((0, 1)).t().unsqueeze(1).to(weight.dtype)  # [W, C] -> [C, 1, W]
        return gx, gw, gtail, None, None, None


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
               doc_ids: torch.Tensor | None = None, silu: bool = False,
               l2_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`k3.ops.conv.short_conv` in Triton: x [B, T, C] (T, C > 0) bf16/fp16/fp32, weight [C, 1, W] with
    W <= MAX_TAPS; `silu`: return SiLU of the conv (the new tail is unchanged); `l2_head` = K (`l2_fusable`,
    with silu): each head of K channels of it L2-normalised."""
    return ShortConvTriton.apply(x, weight, tail, doc_ids, silu, l2_head)
