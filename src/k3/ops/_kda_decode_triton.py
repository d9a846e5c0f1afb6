"""A KDA layer's whole decode step (T = 1) as one Triton kernel: everything between the fused input projection
GEMM and o_proj (SPEC §3.2). Imported only through k3.ops.triton_dispatch (needs triton); the contract and the
plain-PyTorch reference are `k3.ops.kda_decode`.

One program per (row, head) owns that head's channels of the three conv tails and its [K, V] state, so it can
read and rewrite them in place: the three short convs with their tails shifted, SiLU, the q/k L2 norms, the
gate's low-rank second projection (W_fb · f_a, this head's K rows) and bounded decay, beta, the delta rule on
the fp32 state and the gated output RMSNorm (per head, so no cross-program reduction). All math in fp32
registers; the state and each tail are read once and written once. Rows find their state through
a slot table (the serving pool's) or are their own slot (a StaticCache).

Few rows leave the GPU idle at one program a head (batch 1: 12 programs), so a head's state columns are split
over programs, as fla's recurrent kernel splits V (`column_splits`). Every split needs the whole of q and k, hence
the q/k conv tails: each computes them, and the head's last program to finish (an atomic ticket) stores the new
tails, when every split has read the old ones. The output norm needs the whole of o: each split stores its gated
o with its sum of squares kept; the last program scales the [V] output row by 1/rms (the unfused path rounds o to
the model's dtype before its norm too).
Rows that share a slot (a fixed-shape step's padding rows, all on the pool's scratch slot) race for it: split, its
columns may end up from different rows. Nothing reads that slot for a real sequence.
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_rows_l2
from k3.ops.triton_dispatch import inference_op, on_device, sm_count, ticket_workspace

MAX_HEAD_DIM = 128  # q, k, the gate and [K, TILE_V] state tiles are held whole along K; wider heads: unfused


@triton.jit
def _conv_silu(x_ptr, tail_ptr, w_ptr, chans, c_ok, slot_ok, stride_tail_row,
               W: tl.constexpr, TAIL_ROWS: tl.constexpr):
    """SiLU(Σ_j w[c, j] · [tail; x][j, c]) for channels `chans`, and the shifted tail [tail[1:]; x] to store
    once every program's warps have read the old one. x and the old tail are read here, nothing is written;
    the tail reads as zeros where not slot_ok."""
    r = tl.arange(0, TAIL_ROWS)[:, None]
    c = chans[None, :]
    ok = (r < W - 1) & c_ok[None, :]
    x = tl.load(x_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
    tail = tl.load(tail_ptr + r * stride_tail_row + c, mask=ok & slot_ok, other=0.0).to(tl.float32)
    w_tail = tl.load(w_ptr + c * W + r, mask=ok, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + chans * W + (W - 1), mask=c_ok, other=0.0).to(tl.float32)
    y = tl.sum(tail * w_tail, axis=0) + x * w_last
    # row r of the new tail is old row r + 1, and the last row is x
    shifted = tl.load(tail_ptr + (r + 1) * stride_tail_row + c, mask=(r < W - 2) & c_ok[None, :] & slot_ok,
                      other=0.0)
    new_tail = tl.where(r == W - 2, x[None, :], shifted.to(tl.float32))
    return y * tl.sigmoid(y), new_tail


@triton.jit
def kda_decode_kernel(
        xq_ptr, xk_ptr, xv_ptr, fa_ptr, beta_ptr, gate_ptr,  # this step's projections, rows strided
        sx_q, sx_k, sx_v, s_fa, s_beta, s_gate,  # their row strides (columns are contiguous)
        wq_ptr, wk_ptr, wv_ptr, fb_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr,  # the layer's weights
        state_ptr, s_state, tq_ptr, tk_ptr, tv_ptr, s_tq, s_tk, s_tv, r_tq, r_tk, r_tv,  # per-slot storage
        slots_ptr, n_slots, out_ptr, sum_sq_ptr, tickets_ptr,
        H, K, V, R, scale, lower_bound, eps,
        W: tl.constexpr, HAS_SLOTS: tl.constexpr, TAIL_ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
        TILE_V: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    if PREFETCH:
        # this program's block of the state into L2 first: its loads overlap the head's prologue (and, under PDL,
        # the kernel before). The slot is read before the wait for this alone (the engine set it before the
        # step; a stale one costs a useless prefetch) and again after it.
        pf_slot = row
        if HAS_SLOTS:
            pf_slot = tl.load(slots_ptr + row).to(tl.int64)
        pf_ok = (pf_slot >= 0) & (pf_slot < n_slots)
        col0 = sp * (BLOCK_V // SPLITS)
        prefetch_rows_l2(state_ptr + tl.where(pf_ok, pf_slot, 0) * s_state + (h * K + offs_k) * V + col0,
                         k_ok & pf_ok, tl.minimum(BLOCK_V // SPLITS, V - col0), 1)
    pdl_enter(PDL)
    slot = row
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    # a slot outside the storage is neither read nor written (its row reads zero state): never memory corruption
    slot_ok = (slot >= 0) & (slot < n_slots)
    ck = h * K + offs_k  # this head's channels of the q/k columns

    # ---- q, k (whole heads), the gate and beta; the new q/k tails are stored once every program of the head has
    # read the old ones (one program: once its warps have)
    q, tail_q = _conv_silu(xq_ptr + row * sx_q, tq_ptr + slot * s_tq, wq_ptr, ck, k_ok, slot_ok, r_tq, W, TAIL_ROWS)
    k, tail_k = _conv_silu(xk_ptr + row * sx_k, tk_ptr + slot * s_tk, wk_ptr, ck, k_ok, slot_ok, r_tk, W, TAIL_ROWS)
    r = tl.arange(0, TAIL_ROWS)[:, None]
    tail_ok = (r < W - 1) & slot_ok
    tl.debug_barrier()  # (a row or column of a small tile may sit in several warps)
    if SPLITS == 1:
        _store_tails(tq_ptr + slot * s_tq, tk_ptr + slot * s_tk, tail_q, tail_k, r, ck, r_tq, r_tk, tail_ok, k_ok)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale  # L2 norm (eps 1e-6), then the K^-1/2 scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    f = tl.zeros([BLOCK_K], dtype=tl.float32)  # W_fb · f_a, this head's K rows, R_CHUNK columns at a time
    for r0 in tl.static_range(0, BLOCK_R, R_CHUNK):
        offs_r = r0 + tl.arange(0, R_CHUNK)
        r_ok = offs_r < R
        fa = tl.load(fa_ptr + row * s_fa + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        w_fb = tl.load(fb_ptr + ck[:, None] * R + offs_r[None, :], mask=k_ok[:, None] & r_ok[None, :],
                       other=0.0).to(tl.float32)
        f += tl.sum(w_fb * fa[None, :], axis=1)
    dt_bias = tl.load(dt_bias_ptr + ck, mask=k_ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    alpha = tl.exp(lower_bound * tl.sigmoid(rate * (f + dt_bias)))  # exp(g), g in (lower_bound, 0) (SPEC §3.2)
    beta = tl.sigmoid(tl.load(beta_ptr + row * s_beta + h).to(tl.float32))

    # ---- this program's state columns TILE_V at a time (a whole [K, V] tile per thread block spills its
    # registers): v's conv and tail, the delta rule, o gated but not yet normalised, and o's sum of squares
    state_ptr += slot * s_state + h * K * V
    out_ptr += row * H * V + h * V
    sum_sq = 0.0
    for i in range(0, BLOCK_V // SPLITS, TILE_V):  # (constant bounds: Triton's CPU interpreter needs them)
        offs_v = sp * (BLOCK_V // SPLITS) + i + tl.arange(0, TILE_V)
        v_ok = offs_v < V
        cv = h * V + offs_v
        v, tail_v = _conv_silu(xv_ptr + row * sx_v, tv_ptr + slot * s_tv, wv_ptr, cv, v_ok, slot_ok, r_tv, W,
                               TAIL_ROWS)
        s_ptrs = state_ptr + offs_k[:, None] * V + offs_v[None, :]
        s_ok = k_ok[:, None] & v_ok[None, :] & slot_ok
        S = tl.load(s_ptrs, mask=s_ok, other=0.0)
        tl.debug_barrier()
        tl.store(tv_ptr + slot * s_tv + r * r_tv + cv[None, :], tail_v, mask=tail_ok & v_ok[None, :])
        S = S * alpha[:, None]
        u = beta * (v - tl.sum(k[:, None] * S, axis=0))  # β (v − Sᵀk)
        S = S + k[:, None] * u[None, :]
        tl.store(s_ptrs, S, mask=s_ok)
        o = tl.sum(q[:, None] * S, axis=0)
        sum_sq += tl.sum(o * o, axis=0)
        gate = tl.load(gate_ptr + row * s_gate + cv, mask=v_ok, other=0.0).to(tl.float32)
        norm_w = tl.load(norm_w_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_v, (o * norm_w * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty), mask=v_ok)

    # ---- o_norm's 1/rms (per head, SPEC §3.2) over the head's output row, by its last program to finish
    last = True
    if SPLITS > 1:
        tl.store(sum_sq_ptr + (row * H + h) * SPLITS + sp, sum_sq)
        # every thread's stores (and reads of the old tails) precede the ticket (the barrier); the ticket releases
        # them to the program that draws the last one (its acquire), as k3.ops._mla_static_decode_triton's merge
        tl.debug_barrier()
        ticket_ptr = tickets_ptr + row * H + h
        last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == SPLITS - 1
        if last:
            _store_tails(tq_ptr + slot * s_tq, tk_ptr + slot * s_tk, tail_q, tail_k, r, ck, r_tq, r_tk, tail_ok,
                         k_ok)
            # (.cg: from L2, where the other programs' stores are; never a stale line of this SM's L1)
            sum_sq = tl.sum(tl.load(sum_sq_ptr + (row * H + h) * SPLITS + tl.arange(0, SPLITS),
                                    cache_modifier=".cg"), axis=0)
            tl.store(ticket_ptr, 0)
    if last:
        rstd = tl.rsqrt(sum_sq / V + eps)
        tl.debug_barrier()
        for v0 in range(0, BLOCK_V, TILE_V):
            offs_v = v0 + tl.arange(0, TILE_V)
            v_ok = offs_v < V
            y = tl.load(out_ptr + offs_v, mask=v_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + offs_v, (y * rstd).to(out_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _store_tails(tq_ptr, tk_ptr, tail_q, tail_k, r, ck, r_tq, r_tk, tail_ok, k_ok):
    tl.store(tq_ptr + r * r_tq + ck[None, :], tail_q, mask=tail_ok & k_ok[None, :])
    tl.store(tk_ptr + r * r_tk + ck[None, :], tail_k, mask=tail_ok & k_ok[None, :])


# Sized by ptxas for sm_90 at K = V = 128, bf16 (triton 3.6, compiled without a GPU, the arguments specialised as
# launched; session 29): no spill at 32 columns and 4 warps (188 registers), 64 and 4 (252), 64 and 8 (194), 128 and
# 8 (192), 128 and 16 (128); the spills read before session 27 were compile artifacts.
# Timed on the H200 (`bench_gpu_kernels.py --decode-sweep`, session 25, µs a call at
# 1 / 8 / 64 rows): one program a head at 8 warps 15.9 / 16.1 / 80.5; columns split at 8 warps 7.8 / 19.5 / 80.4;
# split at 4 warps 7.4 / 11.7 / 67.6. A head's columns are split over programs while rows × heads leave the GPU
# short of `programs_per_sm` programs an SM (batch 1: 12 heads on 132 SMs), each split at least `tile_v` columns.
# Session 30 on an H100 (same sweep, µs at 1 / 8 / 64 rows): 32 columns and 4 warps 7.1 / 11.8 / 74.2; 64 and 4
# 6.7 / 9.0 / 57.8 (now the default: twice the state bytes in flight a program); 64 and 8 7.3 / 10.1 / 80.1; 128
# and 8 8.4 / 9.7 / 66.8; 128 and 16 11.1 / 12.5 / 79.1. The decode step at batch 64: 3.64 -> 3.45 ms.
# prefetch: the program's state block into L2 at its start (always under PDL: k3.ops._pdl_triton); 66.5 µs at
# 64 rows at 32 columns (H100), slower at 1 and 8.
LAUNCH = dict(tile_v=64, num_warps=4, programs_per_sm=1, prefetch=False)


def column_splits(rows_x_heads: int, block_v: int, device: torch.device) -> int:
    """Programs a head's state columns are split over: a power of two, at most block_v / tile_v."""
    tile_v = min(block_v, LAUNCH["tile_v"])
    sms = sm_count(device.index) if device.type == "cuda" else 2  # (the interpreter: tests set the launch)
    want = triton.cdiv(LAUNCH["programs_per_sm"] * sms, max(rows_x_heads, 1))
    splits = 1
    while splits * 2 <= min(want, block_v // tile_v):
        splits *= 2
    return splits


@inference_op("kda_decode_step", mutates_args=("state", "conv_q", "conv_k", "conv_v"))
def kda_decode_step(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, fa: torch.Tensor,
                    beta_logits: torch.Tensor, gate: torch.Tensor,
                    wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, f_b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                    state: torch.Tensor, conv_q: torch.Tensor, conv_k: torch.Tensor, conv_v: torch.Tensor,
                    slots: torch.Tensor | None, lower_bound: float, eps: float) -> torch.Tensor:
    """`k3.ops.kda_decode.kda_decode_step_reference` in one launch (checked by its caller, `kda_decode_step`
    there). A custom op: torch.compile keeps it as one opaque call that writes the state and tails in place."""
    B, H = beta_logits.shape
    K, V, R, W = xq.shape[1] // H, xv.shape[1] // H, fa.shape[1], wq.shape[-1]
    out = torch.empty(B, H * V, dtype=xq.dtype, device=xq.device)
    if B == 0:
        return out
    block_k, block_v, block_r = triton.next_power_of_2(K), triton.next_power_of_2(V), triton.next_power_of_2(R)
    splits = column_splits(B * H, block_v, xq.device)
    sum_sq = tickets = out  # (one program a head: neither is read; out stands in)
    if splits > 1:
        sum_sq = torch.empty(B * H * splits, dtype=torch.float32, device=xq.device)
        tickets = ticket_workspace(B * H, xq.device)
    launch = pdl.launch(xq)
    with on_device(xq):
        kda_decode_kernel[(B, H, splits)](
            xq, xk, xv, fa, beta_logits, gate,
            xq.stride(0), xk.stride(0), xv.stride(0), fa.stride(0), beta_logits.stride(0), gate.stride(0),
            wq, wk, wv, f_b, A_log, dt_bias, norm_weight,
            state, state.stride(0), conv_q, conv_k, conv_v, conv_q.stride(0), conv_k.stride(0), conv_v.stride(0),
            conv_q.stride(1), conv_k.stride(1), conv_v.stride(1), xq if slots is None else slots, state.shape[0],
            out, sum_sq, tickets,
            H, K, V, R, K ** -0.5, float(lower_bound), float(eps),
            W=W, HAS_SLOTS=slots is not None, TAIL_ROWS=triton.next_power_of_2(max(W - 1, 1)),
            BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_R=block_r, R_CHUNK=min(block_r, 32),
            TILE_V=min(block_v, LAUNCH["tile_v"]), SPLITS=splits, num_warps=LAUNCH["num_warps"],
            PREFETCH=pdl.prefetching(launch, xq, state, opted_in=LAUNCH["prefetch"]), **launch)
    return out


@kda_decode_step.register_fake
def _(xq, xk, xv, fa, beta_logits, gate, wq, wk, wv, f_b, A_log, dt_bias, norm_weight, state, conv_q, conv_k,
      conv_v, slots, lower_bound, eps):
    return xq.new_empty(xq.shape[0], xv.shape[1])
