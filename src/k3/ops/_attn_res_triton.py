"""Triton kernels for the Block AttnRes mix (imported only through k3.ops.triton_dispatch; needs triton).

The mix `out = Σ_i softmax_i(r_i ⟨v_i, u⊙w⟩) · v_i`, r_i = rsqrt(mean(v_i²) + eps), reads each source once
in the forward: the softmax is taken online over the sources (running max, running sum, running weighted sum
in fp32 registers), so nothing of size [n, rows, D] is ever stacked or converted. The sources arrive as a tuple
of tensors, so the n separate [B, T, D] blocks need no copy; each n compiles its own kernel.
Backward is one kernel (_mix_bwd_kernel): a persistent grid of programs, each taking one row a step, issues every
load of the row at once (∂L/∂out, the sources, the addends; a step ahead of the math: BWD_STAGES), forms ∂L/∂a_i =
⟨g, v_i⟩ and Σ v_i² in one reduction per source, then every source's gradient, with one q partial (for ∂L/∂u, ∂L/∂w)
per program summed after it in a fixed order. Its bytes floor is ∂L/∂out once plus, per source, one read, one write
and the addend read: (1 + 3n) · rows · D · 2 bytes in bf16 (1.16 GB, ~260 µs at 4.5 TB/s, for `small`'s average mix
of 3.5 sources at 8 × 4096 tokens; on an H200, session 14: 268 µs at 2 sources against a 171 µs floor, 694 at 5
against 390, where the tiles kernel it replaced took 339 and 915: benchmarks/bench_gpu_kernels.py --backwards).
Formulas: k3.model.attn_res. The forward kernel also takes the residual add before the mix (ADD: training's
`mix_add_forward`, and inference's mix with the norm after it, k3.ops._attn_res_norm_triton), and the RMSNorm after
it (NORM: inference's, and training's `mix_forward(norm=)` / `mix_add_forward(norm=)`, whose backward,
`mix_backward(norm=)`, recomputes the mix from the sources it reads anyway and takes the norm's backward in the same
pass).
"""
import torch
import triton
import triton.language as tl

from k3.ops._pdl_triton import pdl_enter
from k3.ops.triton_dispatch import on_device


@triton.jit
def _mix_fwd_kernel(srcs, uw_ptr, out_ptr, scores_ptr, lse_ptr, add_ptr, sum_ptr, nw_ptr, R, D, eps, norm_eps,
                    N: tl.constexpr, STATS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                    PRELOAD: tl.constexpr = False):
    """STATS: store the scores and log-sum-exp (for backward). ADD: the last source is srcs[N-1] + add, rounded
    to the sources' dtype as a separate add would, and stored to sum_ptr. NORM: out is the RMSNorm (weight
    nw, norm_eps) of the mix, itself rounded to the output dtype first, as the norm would read it. PDL: launched
    with programmatic dependent launch (k3.ops._pdl_triton; inference's mix + norm)."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    out = _mix_rows(srcs, uw_ptr, scores_ptr, lse_ptr, add_ptr, sum_ptr, nw_ptr, rows, cols, R, D, eps, norm_eps,
                    mask, N, STATS, ADD, NORM, out_ptr.dtype.element_ty, PRELOAD)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_rows(srcs, uw_ptr, scores_ptr, lse_ptr, add_ptr, sum_ptr, nw_ptr, rows, cols, R, D, eps, norm_eps,
              sum_mask, N: tl.constexpr, STATS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, out_dtype,
              PRELOAD: tl.constexpr = False):
    """`_mix_fwd_kernel`'s work for a tile of `rows` × `cols` (all of D): the mix (with NORM its RMSNorm) in fp32,
    returned for the caller to store; the sum p + add stored where `sum_mask` (ADD), the scores and log-sum-exp
    where STATS. `out_dtype`: what the mix is rounded to before the norm reads it. PRELOAD: every source loaded
    up front (N tiles in registers; otherwise each load waits behind the previous source's reductions: the
    latency of a decode batch's few rows)."""
    row_ok, col_ok = rows < R, cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    uw = tl.load(uw_ptr + cols, mask=col_ok, other=0.0)
    m = tl.full([rows.shape[0]], float("-inf"), tl.float32)
    l = tl.zeros([rows.shape[0]], tl.float32)
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    vs = ()
    if PRELOAD:  # every source's load issued before the first reduction: one memory latency, not N in a chain
        for i in tl.static_range(N):
            vs = vs + (_load_source(srcs[i], add_ptr, sum_ptr, offs, mask, sum_mask, ADD and i == N - 1),)
    for i in tl.static_range(N):
        if PRELOAD:
            v = vs[i].to(tl.float32)
        else:
            v = _load_source(srcs[i], add_ptr, sum_ptr, offs, mask, sum_mask, ADD and i == N - 1).to(tl.float32)
        sq, dot = tl.reduce((v * v, v * uw[None, :]), 1, _add_pairs)  # one pass across the warps for both sums
        r = tl.rsqrt(sq / D + eps)
        s = r * dot
        if STATS:
            tl.store(scores_ptr + i * R + rows, s, mask=row_ok)
        m_new = tl.maximum(m, s)
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m = m_new
    out = acc / l[:, None]
    if NORM:
        out = out.to(out_dtype).to(tl.float32)
        out = out * tl.rsqrt(tl.sum(out * out, axis=1) / D + norm_eps)[:, None]
        out = out * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if STATS:
        tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)
    return out


@triton.jit
def _load_source(src, add_ptr, sum_ptr, offs, mask, sum_mask, ADD: tl.constexpr):
    """One source's tile in its dtype; ADD: plus the add's tile, rounded to the sources' dtype as a separate add
    would leave it, and stored to sum_ptr where sum_mask."""
    v = tl.load(src + offs, mask=mask, other=0.0)
    if ADD:
        v = (v.to(tl.float32) + tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(v.dtype)
        tl.store(sum_ptr + offs, v, mask=sum_mask)
    return v


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _mix_bwd_row(srcs, grads, addends, g_ptr, uw_ptr, scores_ptr, lse_ptr, nw_ptr, q, dnw, row, R, D, eps,
                 norm_eps, accumulate, N: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row of _mix_bwd_kernel: its sources' gradients stored, q (and with NORM the norm weight's partial dnw)
    plus the row's part returned. NORM: g_ptr holds ∂L/∂y of y = RMSNorm_nw(out); out is recomputed from the
    sources and the softmax weights, rounded to the sources' dtype as the forward rounded it before its norm,
    and ∂L/∂out = r_n (nw⊙∂L/∂y − x̂ mean(nw⊙∂L/∂y⊙x̂)) with x̂ = r_n out, kept in fp32."""
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    row_ok = row < R
    mask = col_ok & row_ok
    offs = row.to(tl.int64) * D + cols
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0)
    vs = ()
    adds = ()
    for i in tl.static_range(N):
        vs = vs + (tl.load(srcs[i] + offs, mask=mask, other=0.0),)
    for i in tl.static_range(N):
        adds = adds + (tl.load(addends[i] + offs, mask=mask & ((accumulate >> i) & 1 != 0), other=0.0),)
    if NORM:
        out = tl.zeros([BLOCK_D], tl.float32)
        for i in tl.static_range(N):
            out += tl.exp(tl.load(scores_ptr + i * R + row, mask=row_ok, other=0.0) - lse) * vs[i].to(tl.float32)
        out = out.to(vs[0].dtype).to(tl.float32)
        r_n = tl.rsqrt(tl.sum(out * out, axis=0) / D + norm_eps)
        x_hat = out * r_n
        dnw += g * x_hat
        g = g * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = (g - x_hat * (tl.sum(g * x_hat, axis=0) / D)) * r_n
    das = ()
    coefs = ()
    for i in tl.static_range(N):
        v = vs[i].to(tl.float32)
        da, sq = tl.reduce((g * v, v * v), 0, _add_pairs)
        s = tl.load(scores_ptr + i * R + row, mask=row_ok, other=0.0)
        a = tl.exp(s - lse)
        r = tl.rsqrt(sq / D + eps)
        das = das + (da,)
        coefs = coefs + ((a, r, s),)
    t = coefs[0][0] * das[0]  # Σ_j a_j ∂L/∂a_j
    for i in tl.static_range(1, N):
        t += coefs[i][0] * das[i]
    uw = tl.load(uw_ptr + cols, mask=col_ok, other=0.0)  # read per row (from cache): registers are short
    for i in tl.static_range(N):
        a, r, s = coefs[i]
        v = vs[i].to(tl.float32)
        coef = a * (das[i] - t) * r
        dv = a * g + coef * uw - (coef * s * r / D) * v + adds[i].to(tl.float32)
        tl.store(grads[i] + offs, dv.to(grads[i].dtype.element_ty), mask=mask)
        q += coef * v
    return q, dnw


@triton.jit(do_not_specialize=["accumulate"])
def _mix_bwd_kernel(srcs, grads, addends, g_ptr, uw_ptr, scores_ptr, lse_ptr, nw_ptr, q_ptr, R, D, eps, norm_eps,
                    iters, accumulate, N: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr,
                    STAGES: tl.constexpr):
    """Every source's gradient and the q partials, one row a step: program p takes rows p, p + P, p + 2P, ...
    (P programs, each holding one fp32 q partial in registers: P partials, summed by the caller in a fixed
    order). A step issues every load of its row at once (∂L/∂out, each source, each addend: nothing is
    stored before them, so an addend that is the gradient's own buffer is read first) and keeps them in
    registers through both halves: the per-source sums (⟨g, v_i⟩ and Σ v_i², one reduction each source),
    then the gradients. accumulate: a bit mask over the sources; where bit i is set, source i's gradient plus
    addends[i] is stored (addends[i] is grads[i] itself for an AttnRes block's sum over the mixes that read it,
    or the gradient a residual add left for a partial sum), else the gradient alone; a run-time value, so the
    masks a model uses share one compiled kernel per source count. STAGES: rows in flight a program (1: a row's
    loads, math and stores in turn). NORM: g_ptr is the gradient of the mix's RMSNorm (nw_ptr, norm_eps), and
    each program's partial of the norm weight's gradient goes to row P + p of q_ptr."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    q = tl.zeros([BLOCK_D], tl.float32)
    dnw = tl.zeros([BLOCK_D], tl.float32)
    if STAGES > 1:  # Triton's pipeliner copies the next row (into shared memory) while this row's math runs
        for it in tl.range(0, iters, num_stages=STAGES):
            q, dnw = _mix_bwd_row(srcs, grads, addends, g_ptr, uw_ptr, scores_ptr, lse_ptr, nw_ptr, q, dnw,
                                  pid + it * nprog, R, D, eps, norm_eps, accumulate, N, NORM, BLOCK_D)
    else:  # (a while: the interpreter, which runs the CPU tensors' launches, cannot range over a run-time count)
        it = 0
        while it < iters:
            q, dnw = _mix_bwd_row(srcs, grads, addends, g_ptr, uw_ptr, scores_ptr, lse_ptr, nw_ptr, q, dnw,
                                  pid + it * nprog, R, D, eps, norm_eps, accumulate, N, NORM, BLOCK_D)
            it += 1
    tl.store(q_ptr + pid * D + cols, q, mask=col_ok)
    if NORM:
        tl.store(q_ptr + (nprog + pid) * D + cols, dnw, mask=col_ok)


# The training forward's launch (`mix_forward`, `mix_add_forward`). preload: every source's tile loaded before the
# first reduction (`_mix_rows`' PRELOAD: N loads in flight a program, not one behind each source's reductions; N
# more bf16 tiles of registers). block_r: rows a program (None: `_blocks`' 4096 elements a program).
LAUNCH = dict(preload=False, block_r=None)

# warps per program of the forward and the backward (4: Triton's default; the rows kernel at 4 warps holds a
# row of five sources and their addends in 249 registers a thread, no spills, on sm_90)
NUM_WARPS = dict(fwd=4, bwd=4)
# The backward's programs per SM by source count (a persistent grid: each program runs to the end, so all of
# them should be resident at once, which the registers a source count compiles to decide: sm_90, bf16, D 1536,
# 4 warps: 132 a thread at 2 sources leave room for 3 programs, 200-249 at 3-5 for 2; benchmarks/
# sass_train_backwards.py). On an H200 (session 14) 3 an SM won at 2 sources (268 µs against 338 at 2 and 358
# at 4) and lost at 5 (864 against 694 at 2); more sources than these: 2
BWD_PROGRAMS_PER_SM = {1: 3, 2: 3, 3: 2, 4: 2, 5: 2}

# Rows the backward's loop keeps in flight a program: 1, each row's loads, math and stores in turn (a program's
# memory idles through its math: on the H200 more programs an SM, not more bytes a program, were what helped);
# 2, the next row's loads issued (cp.async, into shared memory) before this row's math. sm_90, bf16, D 1536:
# 163 registers and 29 KB shared at 2 sources (3 programs an SM still fit), 255 and 53 KB at 5 (2), no spills.
# (CPU tensors, under the interpreter: 1.) On the H200 (session 15, `bench_gpu_kernels.py --backwards`, bf16,
# 8x4096 x 1536) 2 took 249/335/422/482 us at 2-5 sources against 1's 279/444/574/697, with the same gradients:
# ~4 ms off a `small` step. (The conv's 2 stages lost there: `_conv_triton.BWD_STAGES` stays 1.)
BWD_STAGES = 2


def _programs(device: torch.device, n_sources: int) -> int:
    """The backward's grid: fixed per device and source count, so the q partials always sum in one order."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return sms * BWD_PROGRAMS_PER_SM.get(n_sources, 2)


def _blocks(D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, min(16, 4096 // block_d)), block_d


def mix_forward(u: torch.Tensor, w: torch.Tensor, eps: float, sources: tuple[torch.Tensor, ...],
                norm: tuple[torch.Tensor, float] | None = None):
    """(out like sources[0], scores [n, R] fp32, lse [R] fp32) for contiguous sources [..., D] of one dtype.
    norm: as `mix_add_forward`'s."""
    out, scores, lse, _ = _forward(u, w, eps, sources, None, norm)
    return out, scores, lse


def mix_add_forward(u: torch.Tensor, w: torch.Tensor, eps: float, sources: tuple[torch.Tensor, ...],
                    add: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None):
    """`mix_forward` of the sources with the last one replaced by `sources[-1] + add` (the residual add before
    a training mix, in the same launch): (out, that sum, scores, lse). The sum is rounded to the sources' dtype
    before the mix reads it, as the separate add would leave it; `mix_backward` takes it as the last source.
    norm: (weight [D], eps) of an RMSNorm after the mix: out is then the norm's output (the mix itself is never
    stored; `mix_backward(norm=...)` recomputes it)."""
    out, scores, lse, total = _forward(u, w, eps, sources, add, norm)
    return out, total, scores, lse


def _forward(u, w, eps, sources, add, norm=None):
    D = sources[0].shape[-1]
    R = sources[0].numel() // D
    uw = u.float() * w.reshape(-1).float()
    out = torch.empty_like(sources[0])
    total = None if add is None else torch.empty_like(sources[-1])
    scores = torch.empty(len(sources), R, dtype=torch.float32, device=out.device)
    lse = torch.empty(R, dtype=torch.float32, device=out.device)
    block_r, block_d = _blocks(D)
    block_r = LAUNCH["block_r"] or block_r
    with on_device(out):
        _mix_fwd_kernel[(triton.cdiv(R, block_r),)](tuple(sources), uw, out, scores, lse,
                                                    out if add is None else add, out if total is None else total,
                                                    uw if norm is None else norm[0].contiguous(), R, D, eps,
                                                    0.0 if norm is None else norm[1], N=len(sources), STATS=True,
                                                    ADD=add is not None, NORM=norm is not None,
                                                    BLOCK_R=block_r, BLOCK_D=block_d, PRELOAD=LAUNCH["preload"],
                                                    num_warps=NUM_WARPS["fwd"])
    return out, scores, lse, total


def mix_backward(grad_out, u, w, eps, sources, scores, lse, into=None, norm=None):
    """(∂L/∂u, ∂L/∂w [1, D], ∂L/∂sources) of `mix_forward` given ∂L/∂out. into: per source None (a fresh
    gradient), or (buffer like the source, addend or None): the gradient, plus the addend where there is one
    (the buffer itself: added in place), is written into the buffer, which is that source's entry of the
    result. norm: the forward's (weight, eps): grad_out is then the norm output's gradient, and the result has
    a fourth entry, ∂L/∂weight."""
    D = sources[0].shape[-1]
    R = sources[0].numel() // D
    g = grad_out.contiguous()
    uw = u.float() * w.reshape(-1).float()
    into = into or [None] * len(sources)
    grads = tuple(torch.empty_like(s) if dest is None else dest[0] for s, dest in zip(sources, into))
    addends = tuple(dest[1] if dest is not None and dest[1] is not None else grad for dest, grad in zip(into, grads))
    accumulate = sum(1 << i for i, dest in enumerate(into) if dest is not None and dest[1] is not None)
    progs = min(R, _programs(g.device, len(sources)))
    q = torch.empty(1 if norm is None else 2, progs, D, dtype=torch.float32, device=g.device)
    with on_device(g):
        _mix_bwd_kernel[(progs,)](tuple(sources), grads, addends, g, uw, scores, lse,
                                  uw if norm is None else norm[0].contiguous(), q, R, D, eps,
                                  0.0 if norm is None else norm[1], triton.cdiv(R, progs), accumulate,
                                  N=len(sources), NORM=norm is not None, BLOCK_D=triton.next_power_of_2(D),
                                  STAGES=BWD_STAGES if g.device.type != "cpu" else 1, num_warps=NUM_WARPS["bwd"])
    q = q.sum(1)  # the second stage of the sums: the programs' partials in a fixed order (no atomics)
    du, dw = (q[0] * w.reshape(-1).float()).to(u.dtype), (q[0] * u.float()).to(w.dtype).reshape(w.shape)
    return (du, dw, grads) if norm is None else (du, dw, grads, q[1].to(norm[0].dtype))

