"""Triton kernels for decode-time routed experts at batch 8–128, expert by expert (imported only through
k3.ops.triton_dispatch; needs triton). The contract, reference and selector are `k3.ops.moe_decode`.

Past a few tokens the N·k (token, choice) slots land on most experts, so `k3.ops._moe_decode_triton`'s programs,
one a slot, would read the same expert many times. Here each program owns one expert (and a block of its rows):
it scans the [N, k] routing ids itself (N·k ≤ ~1024 ints, a few loads), gathers the slots routed to it,
16 or 32 at a time, and reads its weight tile once for all of them. No sort, histogram, offsets or permuted
copies (the grouped path's ~25 kernels a layer at batch 64). Three launches a layer:
1. gate+up: program (expert, block of I rows) → h[slot] = SiTU-GLU(W1_e z, W3_e z) for every slot routed to e;
2. down: program (expert, block of L rows) → y[slot] = W2_e h[slot], fp32;
3. combine: program (token, block of L) → Σ_j weight_j · y[token·k + j] in the order j = 0..k-1; given the
   LatentMoE's routed norm, one program a token (all of L) also normalises its row as the norm would read it
   (rounded first), and given the shared experts' gate and up, takes their SiTU-GLU of the token in the same launch
   (`expert_major_situ_mlp_tail`: the two small kernels that followed the combine at a decode batch).
Every output element is written by one program and summed in a fixed order (no atomics): the same bits on every
run. An expert no slot chose stops after its scan; a slot with a negative id (held by another expert-parallel
rank), or any id outside [0, E), matches no expert and adds nothing (the ids are compared, never used as an
address); a token that picks an expert twice gets both slots.
The products go through tl.dot (tensor cores for 16-bit weights, exact fp32 FMA for fp32 ones), accumulating in
fp32. L and I are compile-time constants (the pipelined loops, and the bounds the interpreter can run).
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_rows_l2
from k3.ops._situ_triton import _situ_glu
from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import call_op, inference_op, on_device

# Launch shapes (names so a sweep can time others). Untimed first guesses: 64-row weight tiles (≥ 8 programs an
# expert at small's widths: 512 and 768 programs a launch), scan: routing ids read a step of the scan (256 spills
# in gate+up for sm_90: benchmarks/sass_moe_expert_major.py). The slots a pass: `block_m`.
# prefetch: each program puts its first prefetch_steps steps of weight rows in flight into L2 first, so that its
# scan of the routing ids does not hold them back, and keeps that many steps ahead (always under PDL:
# k3.ops._pdl_triton); untimed.
# wide_m_from: the average slots an expert from which a pass takes 32 slots (`block_m`); wide_l_from: the same
# from which down takes down_wide_block_l rows of W2 a program (`down_block_l`).
# split_passes_from: the average slots an expert from which each (expert, block) gets two programs, the first taking
# passes 0, 2, 4, … of BLOCK_M slots and the second 1, 3, 5, … (`passes`): an expert routed past one pass (at batch 64
# near-uniform routing puts 17–18 slots on some expert in ~6 of small's 15 MoE layers) then reads its tiles in two
# programs side by side, not twice in one that the whole launch waits on; a second program with nothing to take
# ends after its scan. Off (2**20): on an H100 (session 43, `--moe-sweep`) it took a hot expert's 26–32 slots in
# 89.5 against 93.3 µs, but the graphed batch-64 step read 3.37 against 3.20 ms; kept for skewed (trained) routing,
# where hot experts are the rule, to be timed there.
# tail: the combine's launch takes the LatentMoE's routed norm and shared GLU where offered
# (k3.ops.moe_decode.selected_experts_tail; false: the caller runs them apart, the A/B of `bench_gpu_decode.py
# --launch _moe_expert_major_triton:tail=false`).
LAUNCH = dict(gate_up_block_i=64, gate_up_block_l=64, down_block_l=64, down_block_i=64, stages=3, warps=4,
              scan=128, combine_block=256, prefetch=False, prefetch_steps=4, wide_m_from=12,
              down_wide_block_l=128, wide_l_from=4, split_passes_from=1 << 20, tail=True)


def block_m(slots: int, experts: int) -> int:
    """Slots an expert's programs take a pass over its weight tile: 16 (tl.dot's least), 32 once the experts
    average more than LAUNCH["wide_m_from"] (12: N > 96 at top-8 of 64), where a second pass, whose tiles come from
    HBM again, would be common. (32 at small's widths: 168 registers, no spills, 3 CTAs an SM. At batch 64 an
    expert averages 8 slots; the busiest of a skewed routing take a second pass of 16, the whole launch waiting on
    them; yet wide_m_from=0, passes of 32 from the first slot, was slower there: H100, session 35, `--moe-sweep`,
    110 µs against 91.5.)"""
    return 32 if slots > LAUNCH["wide_m_from"] * experts else 16


def passes(slots: int, experts: int) -> int:
    """Programs each (expert, block of weight rows) gets: 2 once the experts average at least
    LAUNCH["split_passes_from"] slots (program p takes the passes p, p + 2, …), else 1."""
    return 2 if slots >= LAUNCH["split_passes_from"] * experts else 1


def down_block_l(slots: int, experts: int) -> int:
    """Rows of W2 a down program reads: LAUNCH["down_wide_block_l"] (128) once the experts average at least
    LAUNCH["wide_l_from"] (4) slots, where every expert is busy (small at batch 32: 64·(1−(7/8)³²) ≈ 63.9 of
    64) and half the programs, each twice the rows, still fill the card; down_block_l (64) below, where few
    experts run and the launch wants more programs. Measured with the warmed `--moe-sweep` at small's widths: at
    64 tokens 128 rows took 77.1 µs against 81.8 (H100) and 63.2 against 66.4 (H200); at 8 tokens 51.7 against
    47.3 and 41.7 against 39.5 (session 36)."""
    wide = slots >= LAUNCH["wide_l_from"] * experts
    return LAUNCH["down_wide_block_l"] if wide else LAUNCH["down_block_l"]


@triton.jit
def _routed_slots(idx_ptr, S, e, base, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """(the slots routed to expert e with ranks base .. base+BLOCK_M-1 among them in slot order, -1 past the
    last; how many slots e has) from the flat routing ids idx[0:S]."""
    want = base + tl.arange(0, BLOCK_M)
    found = tl.zeros((BLOCK_M,), dtype=tl.int32)  # slot + 1 of each wanted rank, 0 while not found
    seen = tl.sum(tl.zeros((1,), dtype=tl.int32), 0)  # slots of e before this step's
    s0 = 0
    while s0 < S:
        s = s0 + tl.arange(0, SCAN)
        hit = (tl.load(idx_ptr + s, mask=s < S, other=-1) == e).to(tl.int32)
        rank = seen + tl.cumsum(hit, 0) - 1
        match = (hit[None, :] > 0) & (rank[None, :] == want[:, None])  # [BLOCK_M, SCAN]: one match a row at most
        found += tl.sum(tl.where(match, s[None, :] + 1, 0), 1)
        seen += tl.sum(hit, 0)
        s0 += SCAN
    return found - 1, seen


@triton.jit
def _dot(a, b, DOT_IN_FP32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 sums. DOT_IN_FP32 (fp32 weights; any off the GPU): the exact products of fp32
    (ieee, not tf32), 16-bit tiles converted first, as the interpreter (triton 3.6) multiplies bf16 tiles as their
    raw bits; else the tensor cores' 16-bit products, exact too."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _gate_up_kernel(z_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, S, stride_z, beta_gate, beta_up, TOP_K: tl.constexpr,
                    I: tl.constexpr, L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_L: tl.constexpr, SCAN: tl.constexpr, STAGES: tl.constexpr, EXACT: tl.constexpr,
                    DOT_IN_FP32: tl.constexpr, PASSES: tl.constexpr = 1, PDL: tl.constexpr = False,
                    PREFETCH: tl.constexpr = False, PF_STEPS: tl.constexpr = 1, PF_CHUNKS: tl.constexpr = 1):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # rows of W1_e, W3_e = columns of h
    if PREFETCH:  # the first PF_STEPS steps of this program's rows of W1_e and W3_e, whether a slot is routed or not
        _prefetch_expert_rows(w1_ptr, e, rows, I, L, 0, PF_STEPS * BLOCK_L, PF_CHUNKS)
        _prefetch_expert_rows(w3_ptr, e, rows, I, L, 0, PF_STEPS * BLOCK_L, PF_CHUNKS)
    pdl_enter(PDL)
    w_rows = e.to(tl.int64) * I * L + rows[:, None] * L
    base = tl.program_id(2) * BLOCK_M  # this program's first pass (of PASSES taking turns)
    slots, count = _routed_slots(idx_ptr, S, e, base, BLOCK_M, SCAN)
    while base < count:  # no slot: nothing read (an empty expert's programs end here)
        ok = slots >= 0
        x_rows = z_ptr + (tl.where(ok, slots, 0) // TOP_K).to(tl.int64)[:, None] * stride_z
        acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        for l0 in tl.range(0, L, BLOCK_L, num_stages=STAGES):
            if PREFETCH:  # the step PF_STEPS ahead (all of a program's rows at once would not fit L2 at 64 rows)
                _prefetch_expert_rows(w1_ptr, e, rows, I, L, l0 + PF_STEPS * BLOCK_L, BLOCK_L, PF_CHUNKS)
                _prefetch_expert_rows(w3_ptr, e, rows, I, L, l0 + PF_STEPS * BLOCK_L, BLOCK_L, PF_CHUNKS)
            cols = l0 + tl.arange(0, BLOCK_L)
            x = tl.load(x_rows + cols[None, :], mask=ok[:, None] & (cols[None, :] < L), other=0.0)
            m = (rows[:, None] < I) & (cols[None, :] < L)
            w1 = tl.load(w1_ptr + w_rows + cols[None, :], mask=m, other=0.0)
            w3 = tl.load(w3_ptr + w_rows + cols[None, :], mask=m, other=0.0)
            acc_g += _dot(x, tl.trans(w1), DOT_IN_FP32)
            acc_u += _dot(x, tl.trans(w3), DOT_IN_FP32)
        h = _situ_glu(acc_g, acc_u, beta_gate, beta_up, EXACT)
        tl.store(h_ptr + slots.to(tl.int64)[:, None] * I + rows[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=ok[:, None] & (rows[None, :] < I))
        base += PASSES * BLOCK_M
        slots, _ = _routed_slots(idx_ptr, S, e, base, BLOCK_M, SCAN)


@triton.jit
def _down_kernel(h_ptr, idx_ptr, w2_ptr, y_ptr, S, I: tl.constexpr, L: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr, SCAN: tl.constexpr, STAGES: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, PASSES: tl.constexpr = 1, PDL: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, PF_STEPS: tl.constexpr = 1, PF_CHUNKS: tl.constexpr = 1):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)  # rows of W2_e = columns of y
    if PREFETCH:
        _prefetch_expert_rows(w2_ptr, e, rows, L, I, 0, PF_STEPS * BLOCK_I, PF_CHUNKS)
    pdl_enter(PDL)
    w_rows = e.to(tl.int64) * L * I + rows[:, None] * I
    base = tl.program_id(2) * BLOCK_M  # this program's first pass (of PASSES taking turns)
    slots, count = _routed_slots(idx_ptr, S, e, base, BLOCK_M, SCAN)
    while base < count:
        ok = slots >= 0
        h_rows = h_ptr + tl.where(ok, slots, 0).to(tl.int64)[:, None] * I
        acc = tl.zeros((BLOCK_M, BLOCK_L), dtype=tl.float32)
        for i0 in tl.range(0, I, BLOCK_I, num_stages=STAGES):
            if PREFETCH:
                _prefetch_expert_rows(w2_ptr, e, rows, L, I, i0 + PF_STEPS * BLOCK_I, BLOCK_I, PF_CHUNKS)
            cols = i0 + tl.arange(0, BLOCK_I)
            h = tl.load(h_rows + cols[None, :], mask=ok[:, None] & (cols[None, :] < I), other=0.0)
            w = tl.load(w2_ptr + w_rows + cols[None, :], mask=(rows[:, None] < L) & (cols[None, :] < I), other=0.0)
            acc += _dot(h, tl.trans(w), DOT_IN_FP32)
        tl.store(y_ptr + slots.to(tl.int64)[:, None] * L + rows[None, :], acc, mask=ok[:, None] & (rows[None, :] < L))
        base += PASSES * BLOCK_M
        slots, _ = _routed_slots(idx_ptr, S, e, base, BLOCK_M, SCAN)


@triton.jit
def _prefetch_expert_rows(w_ptr, e, rows, OUT: tl.constexpr, IN: tl.constexpr, col0, COLS: tl.constexpr,
                          CHUNKS: tl.constexpr):
    """Columns col0 .. col0 + COLS (cut at IN) of rows `rows` of expert e's [OUT, IN] matrix of the stack w into L2
    (k3.ops._pdl_triton)."""
    prefetch_rows_l2(w_ptr + (e.to(tl.int64) * OUT + rows) * IN + col0, rows < OUT, tl.minimum(COLS, IN - col0),
                     CHUNKS)


@triton.jit
def _combine_kernel(y_ptr, idx_ptr, wt_ptr, out_ptr, E, L, nw_ptr, eps, g_ptr, u_ptr, h_ptr, stride_g, stride_u,
                    beta_gate, beta_up, TOP_K: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr = False,
                    GLU: tl.constexpr = False, I_SHARED: tl.constexpr = 0, BLOCK_G: tl.constexpr = 16,
                    EXACT: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # a fixed order: the same sum on every run
        s = n * TOP_K + j
        e = tl.load(idx_ptr + s)
        held = (e >= 0) & (e < E)  # no expert program matched the others: their y rows were never written
        wt = tl.where(held, tl.load(wt_ptr + s).to(tl.float32), 0.0)
        acc += wt * tl.load(y_ptr + s.to(tl.int64) * L + cols, mask=(cols < L) & held, other=0.0)
    if NORM:  # (one program a token: BLOCK covers L) the row as stored, normalised in fp32 as k3.ops.norm does
        x = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
        acc = x * rstd * tl.load(nw_ptr + cols, mask=cols < L, other=0.0).to(tl.float32)
    tl.store(out_ptr + n.to(tl.int64) * L + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < L)
    if GLU:  # the shared experts' SiTU-GLU of this token, by its first program
        if tl.program_id(1) == 0:
            for c0 in tl.static_range(0, I_SHARED, BLOCK_G):
                c = c0 + tl.arange(0, BLOCK_G)
                ok = c < I_SHARED
                gate = tl.load(g_ptr + n.to(tl.int64) * stride_g + c, mask=ok, other=0.0).to(tl.float32)
                up = tl.load(u_ptr + n.to(tl.int64) * stride_u + c, mask=ok, other=0.0).to(tl.float32)
                h = _situ_glu(gate, up, beta_gate, beta_up, EXACT)
                tl.store(h_ptr + n.to(tl.int64) * I_SHARED + c, h.to(h_ptr.dtype.element_ty), mask=ok)


def expert_major_situ_mlp(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """Same contract as k3.ops.moe_decode.selected_experts_situ_mlp_reference (z: [N, L], idx/weights: [N, k];
    w1, w2, w3 in z's dtype; inputs checked by the caller). The custom op `k3::moe_expert_major` inside
    torch.compile, its function directly elsewhere (k3.ops.triton_dispatch.call_op)."""
    return call_op("moe_expert_major", z, idx, weights, w1, w3, w2, float(beta_gate), float(beta_up), None, 0.0,
                   None, None, 0.0, 0.0)[0]


def expert_major_situ_mlp_tail(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                               w3: torch.Tensor, w2: torch.Tensor, beta_gate: float, beta_up: float,
                               norm_weight: torch.Tensor | None, norm_eps: float, gate: torch.Tensor,
                               up: torch.Tensor, shared_beta_gate: float,
                               shared_beta_up: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as k3.ops.moe_decode.selected_experts_tail_reference: (the experts' sum normalised by
    norm_weight where given, SiTU-GLU(gate, up)), the norm and the GLU in the combine's launch; inputs checked by
    the caller."""
    return call_op("moe_expert_major", z, idx, weights, w1, w3, w2, float(beta_gate), float(beta_up), norm_weight,
                   float(norm_eps), gate, up, float(shared_beta_gate), float(shared_beta_up))


# A custom op so that torch.compile keeps the three launches as one call (inference only). Outputs: (the experts'
# sum, normalised where norm_weight is given; the shared GLU's output, empty where gate is not given: an op's
# outputs cannot be None).
@inference_op("moe_expert_major")
def _expert_major_op(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, beta_gate: float, beta_up: float,
                     norm_weight: torch.Tensor | None, norm_eps: float, gate: torch.Tensor | None,
                     up: torch.Tensor | None, shared_beta_gate: float,
                     shared_beta_up: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, k = idx.shape
    E, I, L = w1.shape
    out = torch.empty(N, L, dtype=z.dtype, device=z.device)
    i_shared = 0 if gate is None else gate.shape[1]
    h_shared = z.new_empty(0) if gate is None else torch.empty(N, i_shared, dtype=gate.dtype, device=z.device)
    if N * k == 0:  # no slot: the sum (and so its norm) is zero; the GLU still has its rows to take
        return out.zero_(), h_shared if gate is None else situ_glu(gate, up, shared_beta_gate, shared_beta_up)
    if z.stride(1) != 1:  # (rows may be strided: z is a slice of the MoE's fused input projection)
        z = z.contiguous()
    idx, weights = idx.contiguous(), weights.contiguous()
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    h = torch.empty(N * k, I, dtype=z.dtype, device=z.device)  # rounded as the reference rounds SiTU's output
    y = torch.empty(N * k, L, dtype=torch.float32, device=z.device)
    p = LAUNCH
    split = passes(N * k, E)
    common = dict(BLOCK_M=block_m(N * k, E), SCAN=p["scan"], STAGES=p["stages"], PASSES=split,
                  DOT_IN_FP32=not z.is_cuda or z.dtype == torch.float32, num_warps=p["warps"])
    launch = pdl.launch(z)
    prefetch = pdl.prefetching(launch, z, w1, w3, w2, opted_in=p["prefetch"])
    with on_device(z):
        _gate_up_kernel[(E, triton.cdiv(I, p["gate_up_block_i"]), split)](
            z, idx, w1, w3, h, N * k, z.stride(0), float(beta_gate), float(beta_up), TOP_K=k, I=I, L=L,
            BLOCK_I=p["gate_up_block_i"], BLOCK_L=p["gate_up_block_l"], EXACT=z.dtype == torch.float32, **common,
            PREFETCH=prefetch, PF_STEPS=p["prefetch_steps"], PF_CHUNKS=max(1, 32 * p["warps"] // p["gate_up_block_i"]),
            **launch)
        rows_l = down_block_l(N * k, E)
        _down_kernel[(E, triton.cdiv(L, rows_l), split)](
            h, idx, w2, y, N * k, I=I, L=L, BLOCK_L=rows_l, BLOCK_I=p["down_block_i"], **common,
            PREFETCH=prefetch, PF_STEPS=p["prefetch_steps"], PF_CHUNKS=max(1, 32 * p["warps"] // rows_l), **launch)
        # (the norm wants a token's whole row in one program)
        block = triton.next_power_of_2(L) if norm_weight is not None else min(p["combine_block"],
                                                                              triton.next_power_of_2(L))
        g, u, h_out = (out, out, out) if gate is None else (gate, up, h_shared)  # (unread stand-ins without the GLU)
        _combine_kernel[(N, triton.cdiv(L, block))](
            y, idx, weights, out, E, L, out if norm_weight is None else norm_weight, float(norm_eps), g, u, h_out,
            g.stride(0), u.stride(0), float(shared_beta_gate), float(shared_beta_up), TOP_K=k, BLOCK=block,
            NORM=norm_weight is not None, GLU=gate is not None, I_SHARED=i_shared,
            BLOCK_G=min(1024, triton.next_power_of_2(max(i_shared, 1))), EXACT=z.dtype == torch.float32,
            num_warps=4, **launch)
    return out, h_shared


@_expert_major_op.register_fake
def _(z, idx, weights, w1, w3, w2, beta_gate, beta_up, norm_weight, norm_eps, gate, up, shared_beta_gate,
      shared_beta_up):
    h = z.new_empty(0) if gate is None else gate.new_empty(idx.shape[0], gate.shape[1])
    return z.new_empty(idx.shape[0], w1.shape[2]), h
