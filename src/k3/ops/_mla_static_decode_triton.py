"""Triton kernel for MLA's absorbed decode over a StaticCache, in one launch (imported only through
k3.ops.triton_dispatch; needs triton): the new token's latent and k_rope written into the cache at the device
length, the scores of every head over the cached tokens and the new one, the masked softmax and `p · latent`.

Program (row, block of heads, split of the cache) walks its split with an online softmax, as
k3.ops._mla_decode_triton does over the paged pool (all heads share MLA's one latent, so each loaded tile serves
every head), and writes its partial (acc, max, sum) to an fp32 scratch. The last program of a (row, head block)
to finish (an atomic ticket, as in k3.ops._router_triton) merges the splits into the context and sets the ticket
back to zero, so the workspace stays zero between launches and a CUDA graph replays it as captured; launches
sharing one workspace must not run at the same time. The new token is never read back from the cache: the
split that holds its slot takes it from the inputs, and only that split's first head block writes it there.
The new latent may come un-normalised with its RMSNorm's weight (NORM): every program loads the whole row anyway
(BLOCK_R ≥ R), so each takes its rstd and applies the norm as k3.ops.norm.rms_norm does (fp32, rounded to the
latent's dtype) before it is stored or read: MLA's kv_a_layernorm launches nothing of its own then.
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_range_l2
from k3.ops.triton_dispatch import call_op, inference_op, on_device, sm_count


@triton.jit
def _static_decode_kernel(q_lat_ptr, q_lat_row, q_lat_head, q_rope_ptr, q_rope_row, q_rope_head, new_lat_ptr,
                          new_lat_row, new_rope_ptr, new_rope_row, lat_ptr, rope_ptr, length_ptr, acc_ptr, m_ptr,
                          l_ptr, tickets_ptr, out_ptr, norm_w_ptr, norm_eps, H, R, E, max_len, scale, split_len, splits,
                          head_blocks, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                          NORM: tl.constexpr, DOT16: tl.constexpr, PDL: tl.constexpr = False,
                          PREFETCH: tl.constexpr = False, PF_TILES: tl.constexpr = 1, PF_CHUNKS: tl.constexpr = 1):
    b, hb, sp = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    if PREFETCH and hb == 0:
        # the first PF_TILES tiles of this split's cache rows into L2 first, before the length is known (past it a
        # prefetch goes unread); the loop keeps PF_TILES tiles ahead (a whole split at once would not fit L2 at
        # 64 rows: 168 MB of cache)
        _prefetch_cache_rows(lat_ptr, rope_ptr, b * max_len + sp * split_len,
                             tl.minimum(split_len, max_len - sp * split_len), R, E, PF_TILES * BLOCK_N, PF_CHUNKS)
    pdl_enter(PDL)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r, e = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_E)
    h_ok, r_ok, e_ok = heads < H, r < R, e < E
    q_rows = b * H + heads
    # DOT16: the tensor cores' 16-bit products of the cache's dtype (fp32 sums; the probabilities rounded to that
    # dtype for p·latent), half the registers of fp32 tiles. Else the products in fp32: a bf16/fp16 value is
    # exact in tf32, which PRECISION then names for them (Triton's interpreter multiplies 16-bit tiles wrongly).
    q_lat = tl.load(q_lat_ptr + b * q_lat_row + heads[:, None] * q_lat_head + r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + b * q_rope_row + heads[:, None] * q_rope_head + e[None, :],
                     mask=h_ok[:, None] & e_ok[None, :], other=0.0)
    if DOT16:
        q_lat, q_rope = q_lat.to(lat_ptr.dtype.element_ty), q_rope.to(rope_ptr.dtype.element_ty)
    else:
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    pos = tl.load(length_ptr)  # the new token's slot; the context is tokens 0..pos
    start = sp * split_len
    end = tl.minimum(tl.minimum(start + split_len, pos + 1), max_len)  # (a full cache: nothing read past it)
    # the new token in the cache's dtype: the value every later step reads back
    new_lat = tl.load(new_lat_ptr + b * new_lat_row + r, mask=r_ok, other=0.0)
    if NORM:  # rms_norm's order: x·rstd·w in fp32, one rounding to the latent's dtype
        x = new_lat.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + norm_eps)
        # (not `w`: the merge's loop below reuses that name at another shape, which Triton rejects as loop-carried)
        norm_w = tl.load(norm_w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        new_lat = (x * rstd * norm_w).to(new_lat_ptr.dtype.element_ty)
    new_lat = new_lat.to(lat_ptr.dtype.element_ty)
    new_rope = tl.load(new_rope_ptr + b * new_rope_row + e, mask=e_ok, other=0.0).to(rope_ptr.dtype.element_ty)
    cache_row = b * max_len
    if (hb == 0) & (start <= pos) & (pos < start + split_len) & (pos < max_len):
        tl.store(lat_ptr + (cache_row + pos) * R + r, new_lat, mask=r_ok)
        tl.store(rope_ptr + (cache_row + pos) * E + e, new_rope, mask=e_ok)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # one tile ahead: the next tile's loads are in flight while this one's dots and softmax run (a while loop is
    # not software-pipelined by Triton, and Triton's CPU interpreter cannot run `range` over runtime bounds)
    t0 = start
    old_end = tl.minimum(pos, end)  # tokens below it were written by earlier steps
    lat_next, rope_next = _cached_tile(lat_ptr, rope_ptr, cache_row, t0, old_end, r, e, r_ok, e_ok, R, E, BLOCK_N)
    while t0 < end:
        if PREFETCH and hb == 0:  # the tile PF_TILES ahead
            ahead = t0 + PF_TILES * BLOCK_N
            _prefetch_cache_rows(lat_ptr, rope_ptr, cache_row + ahead, old_end - ahead, R, E, BLOCK_N, PF_CHUNKS)
        tok = t0 + tl.arange(0, BLOCK_N)
        t_ok = tok < end
        is_new = (tok == pos)[:, None]  # written by this step: it comes from the inputs
        lat = tl.where(is_new, new_lat[None, :], lat_next)
        k_rope = tl.where(is_new, new_rope[None, :], rope_next)
        if not DOT16:
            lat, k_rope = lat.to(tl.float32), k_rope.to(tl.float32)
        lat_next, rope_next = _cached_tile(lat_ptr, rope_ptr, cache_row, t0 + BLOCK_N, old_end, r, e, r_ok, e_ok,
                                           R, E, BLOCK_N)
        sc = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        sc += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        sc = tl.where(t_ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if DOT16:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision=PRECISION)
        m = m_new
        t0 += BLOCK_N
    part = (b * splits + sp) * H + heads
    tl.store(acc_ptr + part[:, None] * R + r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(m_ptr + part, m, mask=h_ok)
    tl.store(l_ptr + part, l, mask=h_ok)
    # every thread's partial stores precede the ticket (the barrier); the ticket releases them to the program
    # that draws the last one (its acquire)
    tl.debug_barrier()
    ticket_ptr = tickets_ptr + b * head_blocks + hb
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == splits - 1:
        # every split's max and sum at once (.cg: from L2, where the other programs' stores are; never a stale
        # line of this SM's L1); a split past the context has m = -inf and weighs 0; split 0 always holds token 0
        s_idx = tl.arange(0, BLOCK_S)
        stats = (b * splits + s_idx[:, None]) * H + heads[None, :]
        s_ok = (s_idx[:, None] < splits) & h_ok[None, :]
        m_all = tl.load(m_ptr + stats, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        l_all = tl.load(l_ptr + stats, mask=s_ok, other=0.0, cache_modifier=".cg")
        m_max = tl.where(h_ok, tl.max(m_all, axis=0), 0.0)
        total = tl.sum(tl.exp(m_all - m_max[None, :]) * l_all, axis=0)
        # the partial contexts (and their maxima) one split ahead, as the main loop's tiles
        acc_rows = acc_ptr + ((b * splits) * H + heads[:, None]) * R + r[None, :]
        m_rows = m_ptr + b * splits * H + heads
        hr_ok = h_ok[:, None] & r_ok[None, :]
        part_next = tl.load(acc_rows, mask=hr_ok, other=0.0, cache_modifier=".cg")
        m_next = tl.load(m_rows, mask=h_ok, other=0.0, cache_modifier=".cg")
        ctx = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        s = 0
        while s < splits:
            this, m_s = part_next, m_next
            more = s + 1 < splits
            part_next = tl.load(acc_rows + (s + 1) * H * R, mask=hr_ok & more, other=0.0, cache_modifier=".cg")
            m_next = tl.load(m_rows + (s + 1) * H, mask=h_ok & more, other=0.0, cache_modifier=".cg")
            ctx += tl.exp(m_s - m_max)[:, None] * this
            s += 1
        ctx = ctx / tl.where(h_ok, total, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * R + r[None, :], ctx.to(out_ptr.dtype.element_ty), mask=hr_ok)
        tl.store(ticket_ptr, 0)


@triton.jit
def _prefetch_cache_rows(lat_ptr, rope_ptr, first, rows, R, E, MOST: tl.constexpr, CHUNKS: tl.constexpr):
    """Cache rows first .. first + min(rows, MOST) of the latent and k_rope into L2 (none where rows ≤ 0)."""
    n = tl.minimum(rows, MOST)
    prefetch_range_l2(lat_ptr + first * R, n * R, CHUNKS)
    prefetch_range_l2(rope_ptr + first * E, n * E, CHUNKS)


@triton.jit
def _cached_tile(lat_ptr, rope_ptr, cache_row, t0, below, r, e, r_ok, e_ok, R, E, BLOCK_N: tl.constexpr):
    """The cache's latent and k_rope rows of tokens t0 .. t0 + BLOCK_N that lie below `below` (zeros elsewhere)."""
    tok = t0 + tl.arange(0, BLOCK_N)
    rows = (cache_row + tok)[:, None]
    ok = (tok < below)[:, None]
    lat = tl.load(lat_ptr + rows * R + r[None, :], mask=ok & r_ok[None, :], other=0.0)
    k_rope = tl.load(rope_ptr + rows * E + e[None, :], mask=ok & e_ok[None, :], other=0.0)
    return lat, k_rope


# Heads per program (tl.dot needs every dimension >= 16), tokens per tile, the fewest tokens a split takes, programs
# an SM the splits aim for, the most splits (the last program merges them one by one), warps. Timed on the H200
# (`bench_gpu_kernels.py --decode-sweep`, small's widths at 4K tokens, µs at 1 / 8 / 64 rows), session 26: splits of
# ≥ 256 tokens 27 / 29.1 / 139, ≥ 128 (33 splits at one row; the same launch at 8 and 64) 22.3 / 28.7 / 139; 2
# programs an SM 27 / 27.1 / 147; 4 warps 40 / 44 / 312. The merge four splits a step (a [4, heads, R] tile, one
# step ahead) was slower: 104 / 65 / 151 against 23 / 30 / 141 in the same call.
# dot16: the 16-bit products on the tensor cores instead of tf32 products of fp32 tiles (CUDA, bf16/fp16 caches
# only: the interpreter multiplies 16-bit tiles wrongly). Session 29 (same sweep, µs at 1 / 8 / 64 rows): the
# launch before (tf32, 32-token tiles) 22.1 / 29.2 / 140; dot16 18.8 / 21.9 / 114; **dot16 with 64-token tiles
# 18.1 / 19.1 / 76.5** (52% of the floor at 64 rows: twice the bytes in flight a CTA; taken); dot16, 16-token
# tiles, 4 warps, two CTAs an SM 22.6 / 25.7 / 105; 16-token tiles 21.9-37.4 / 27-37 / 176-208. sm_90 (ptxas, the
# arguments specialised as launched, 8 warps): 255 registers, no spill (8 B a thread with the latent's norm).
# prefetch: each split's cache rows into L2 prefetch_tiles tiles ahead of its loads, from the program's start
# (always under PDL: k3.ops._pdl_triton); slower everywhere (session 29: 26.4 / 36.6 / 286 µs tf32, 23 / 29 / 241
# dot16), so off.
LAUNCH = dict(block_h=16, block_n=64, min_split=128, programs_per_sm=1, max_splits=128, num_warps=8, dot16=True,
              prefetch=False, prefetch_tiles=8)


def launch_shape(B: int, H: int, max_len: int, device: torch.device) -> tuple[int, int, int]:
    """(head blocks, splits, tokens a split): enough programs to fill the GPU LAUNCH["programs_per_sm"] deep, each
    split at least LAUNCH["min_split"] tokens of the cache's capacity (fixed by it, so a CUDA graph replays the
    launch at any length). The interpreter gets a few splits, for the tests."""
    head_blocks = triton.cdiv(H, LAUNCH["block_h"])
    slots = LAUNCH["programs_per_sm"] * sm_count(device.index) if device.type == "cuda" else 4
    splits = max(1, min(triton.cdiv(max_len, LAUNCH["min_split"]), slots // (B * head_blocks), LAUNCH["max_splits"]))
    split_len = LAUNCH["block_n"] * triton.cdiv(triton.cdiv(max_len, splits), LAUNCH["block_n"])
    return head_blocks, triton.cdiv(max_len, split_len), split_len


def static_decode_attention(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length, scale: float,
                            tickets: torch.Tensor, norm_weight: torch.Tensor | None = None,
                            norm_eps: float = 0.0) -> torch.Tensor:
    """k3.ops.mla_static_decode.static_decode_attention_reference's contract, through the custom op
    `k3::mla_static_decode` (inside torch.compile; its function directly elsewhere: k3.ops.triton_dispatch.call_op);
    inputs checked by the caller, k3.ops.mla_static_decode.static_decode_attention."""
    return call_op("mla_static_decode", q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length,
                   float(scale), tickets, norm_weight, float(norm_eps))


# A custom op so that torch.compile keeps the launch as one opaque call. The cache buffers are written (the new
# token), and the workspace is declared written too: the kernel's atomics do write it, though they leave it zero.
@inference_op("mla_static_decode", mutates_args=("cache_latent", "cache_k_rope", "tickets"))
def _static_decode_op(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      cache_latent: torch.Tensor, cache_k_rope: torch.Tensor, length: torch.Tensor, scale: float,
                      tickets: torch.Tensor, norm_weight: torch.Tensor | None = None,
                      norm_eps: float = 0.0) -> torch.Tensor:
    B, H, R = q_lat.shape
    E, max_len = q_rope.shape[-1], cache_latent.shape[1]
    out = torch.empty(B, H, R, dtype=cache_latent.dtype, device=q_lat.device)
    head_blocks, splits, split_len = launch_shape(B, H, max_len, q_lat.device)
    acc = torch.empty(B, splits, H, R, dtype=torch.float32, device=q_lat.device)
    m = torch.empty(B, splits, H, dtype=torch.float32, device=q_lat.device)
    l = torch.empty_like(m)
    block_r = max(16, triton.next_power_of_2(R))
    launch = pdl.launch(q_lat)
    with on_device(q_lat):
        _static_decode_kernel[(B, head_blocks, splits)](
            q_lat, q_lat.stride(0), q_lat.stride(1), q_rope, q_rope.stride(0), q_rope.stride(1), latent,
            latent.stride(0), k_rope, k_rope.stride(0), cache_latent, cache_k_rope, length, acc, m, l, tickets, out,
            out if norm_weight is None else norm_weight, norm_eps,  # (out: an unread stand-in pointer)
            H, R, E, max_len, scale, split_len, splits, head_blocks, BLOCK_H=LAUNCH["block_h"], BLOCK_R=block_r,
            BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_N=LAUNCH["block_n"],
            BLOCK_S=triton.next_power_of_2(splits),
            PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",  # (tf32: exact for bf16/fp16 values)
            NORM=norm_weight is not None, num_warps=LAUNCH["num_warps"],
            DOT16=LAUNCH["dot16"] and q_lat.is_cuda and cache_latent.dtype in (torch.bfloat16, torch.float16),
            PREFETCH=pdl.prefetching(launch, q_lat, cache_latent, cache_k_rope, opted_in=LAUNCH["prefetch"]),
            PF_TILES=LAUNCH["prefetch_tiles"], PF_CHUNKS=32 * LAUNCH["num_warps"], **launch)
    return out


@_static_decode_op.register_fake
def _(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length, scale, tickets, norm_weight=None,
      norm_eps=0.0):
    return q_lat.new_empty(q_lat.shape, dtype=cache_latent.dtype)
