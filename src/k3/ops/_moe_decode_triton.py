"""Triton kernels for decode-time routed experts (imported only through k3.ops.triton_dispatch; needs triton).

Each (token, choice) slot reads its own expert's rows in place, so a decode step reads exactly the k selected
experts: no gathered weight copies, no sort, no grouped-GEMM offsets. Two launches a layer:
1. gate+up: program (slot, block of I rows) → h = SiTU-GLU(W1_e z, W3_e z), fp32 accumulation;
2. down: program (token, block of L rows) → Σ_j weight_j · W2_{e_j} h_j, the k choices summed in registers.
A slot whose expert id is negative (held by another expert-parallel rank) reads and computes nothing.
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_range_l2, prefetch_rows_l2
from k3.ops._situ_triton import _situ_glu
from k3.ops.triton_dispatch import call_op, inference_op, on_device


# Launch shapes (names, so that a sweep can time others): rows of W1/W3 a gate+up program, columns a step along L,
# rows of W2 a down program; a loop of up to `whole_unroll` steps is unrolled whole (small's: every load of a program
# in flight at once), a longer one `unroll` steps at a time (sm_90, 2 warps, arguments specialised as launched: the
# released widths' 14-step gate+up loop spills 232 B a thread unrolled whole, nothing 2 at a time with 138
# registers). H200, session 26
# (`bench_gpu_kernels.py --decode-sweep`, small's experts L2-cold, both launches, µs at 1 / 2 tokens; floor 4.6 /
# 8.0): with one reduction a program, 2 warps 12.2 / 18.3, 8 warps 16.5 / 21.5, 8 warps and 2 rows a down program
# 13.8 / 21.6; before (a reduction a step or expert), 4 warps 18.5 / 25.7, 8 warps 16.7 / 22.5, 2 warps 20.4 / 26.2.
LAUNCH = dict(gate_up_block_i=8, gate_up_block_l=256, down_block_l=4, down_block_i=512, num_warps=2, whole_unroll=3,
              unroll=2)


@triton.jit
def _gate_up_kernel(z_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, TOP_K, beta_gate, beta_up, I: tl.constexpr,
                    L: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, UNROLL: tl.constexpr,
                    EXACT: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                    E: tl.constexpr = 0, PF_CHUNKS: tl.constexpr = 1):
    s = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    if PREFETCH:  # this program's rows of its expert's W1 and W3 (each one contiguous block), as the down kernel's
        pf_e = tl.load(idx_ptr + s).to(tl.int64)
        row0 = tl.program_id(1) * BLOCK_I
        ok = (pf_e >= 0) & (pf_e < E)
        count = tl.where(ok, tl.minimum(BLOCK_I, I - row0) * L, 0)
        first = (tl.where(ok, pf_e, 0) * I + row0) * L
        prefetch_range_l2(w1_ptr + first, count, PF_CHUNKS)
        prefetch_range_l2(w3_ptr + first, count, PF_CHUNKS)
    pdl_enter(PDL)
    e = tl.load(idx_ptr + s).to(tl.int64)
    if e < 0:  # a slot another rank computes: no weight read (the down kernel skips it too)
        return
    token = s // TOP_K
    # products summed elementwise over the steps, reduced across the warps once at the end (a reduction a step
    # would put a barrier between the steps)
    acc_g = tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32)
    base = e * I * L
    for l0 in tl.range(0, L, BLOCK_L, loop_unroll_factor=UNROLL):
        cols = l0 + tl.arange(0, BLOCK_L)
        x = tl.load(z_ptr + token * L + cols, mask=cols < L, other=0.0).to(tl.float32)
        offs = base + rows[:, None] * L + cols[None, :]
        m = (rows[:, None] < I) & (cols[None, :] < L)
        acc_g += tl.load(w1_ptr + offs, mask=m, other=0.0).to(tl.float32) * x[None, :]
        acc_u += tl.load(w3_ptr + offs, mask=m, other=0.0).to(tl.float32) * x[None, :]
    acc_g = tl.sum(acc_g, 1)
    acc_u = tl.sum(acc_u, 1)
    tl.store(h_ptr + s * I + rows, _situ_glu(acc_g, acc_u, beta_gate, beta_up, EXACT).to(h_ptr.dtype.element_ty),
             mask=rows < I)


@triton.jit
def _down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, out_ptr, I: tl.constexpr, L: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, E: tl.constexpr = 0, K_PAD: tl.constexpr = 1,
                 PF_CHUNKS: tl.constexpr = 1):
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    if PREFETCH:
        # this program's rows of its k experts' W2 (one contiguous block each) into L2. The ids are read before the
        # wait, for the prefetch alone: the router wrote them kernels ago, and were one stale, a prefetch would miss
        # (never an address outside the stack: ids outside [0, E) prefetch nothing); the loads below read them again
        j = tl.arange(0, K_PAD)
        e = tl.load(idx_ptr + n * TOP_K + j, mask=j < TOP_K, other=-1).to(tl.int64)
        ok = (e >= 0) & (e < E)
        row0 = tl.program_id(1) * BLOCK_L
        prefetch_rows_l2(w2_ptr + tl.where(ok, e, 0) * L * I + row0 * I, ok, tl.minimum(BLOCK_L, L - row0) * I,
                         PF_CHUNKS)
    pdl_enter(PDL)
    acc = tl.zeros((BLOCK_L, BLOCK_I), dtype=tl.float32)  # reduced across the warps once, after every expert
    for j in tl.static_range(TOP_K):  # unrolled, and no branch: the k experts' loads are in flight together
        s = n * TOP_K + j
        e = tl.load(idx_ptr + s).to(tl.int64)
        held = e >= 0  # e < 0: held by another rank, its loads masked off (nothing read)
        e = tl.maximum(e, 0)
        wt = tl.where(held, tl.load(wt_ptr + s).to(tl.float32), 0.0)
        for i0 in tl.range(0, I, BLOCK_I, loop_unroll_factor=UNROLL):
            cols = i0 + tl.arange(0, BLOCK_I)
            h = tl.load(h_ptr + s * I + cols, mask=(cols < I) & held, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + e * L * I + rows[:, None] * I + cols[None, :],
                        mask=(rows[:, None] < L) & (cols[None, :] < I) & held, other=0.0).to(tl.float32)
            acc += w * (wt * h)[None, :]
    tl.store(out_ptr + n * L + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=rows < L)


def _unroll(steps: int) -> int:
    return steps if steps <= LAUNCH["whole_unroll"] else LAUNCH["unroll"]


def selected_experts_situ_mlp(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                              w3: torch.Tensor, w2: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    """Same contract as k3.ops.moe_decode.selected_experts_situ_mlp_reference (z: [N, L], idx/weights: [N, k]).
    The custom op `k3::moe_selected_experts` inside torch.compile, its function directly elsewhere
    (k3.ops.triton_dispatch.call_op)."""
    return call_op("moe_selected_experts", z, idx, weights, w1, w3, w2, float(beta_gate), float(beta_up))


# A custom op so that torch.compile keeps the two launches as one call (inference only): traced as plain PyTorch
# instead, batch 1's compiled decode step had inductor's gathers and products in their place (297 kernels a step
# of `small` against the eager step's 160; session 33, H100).
@inference_op("moe_selected_experts")
def _selected_experts_op(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, beta_gate: float, beta_up: float) -> torch.Tensor:
    N, k = idx.shape
    E, I, L = w1.shape
    if N * k == 0:
        return z.new_zeros(N, L)
    z, idx, weights = z.contiguous(), idx.contiguous(), weights.float().contiguous()
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    h = torch.empty(N * k, I, dtype=z.dtype, device=z.device)
    p = LAUNCH
    block_l = min(p["gate_up_block_l"], triton.next_power_of_2(L))
    block_i = min(p["down_block_i"], triton.next_power_of_2(I))
    launch = pdl.launch(z)
    out = torch.empty(N, L, dtype=z.dtype, device=z.device)
    with on_device(z):
        # small row blocks: a decode step has few slots, so the programs come from the rows (≥ 4 per SM at small)
        _gate_up_kernel[(N * k, triton.cdiv(I, p["gate_up_block_i"]))](
            z, idx, w1, w3, h, k, float(beta_gate), float(beta_up), I=I, L=L, BLOCK_I=p["gate_up_block_i"],
            BLOCK_L=block_l, UNROLL=_unroll(triton.cdiv(L, block_l)), EXACT=z.dtype == torch.float32,
            num_warps=p["num_warps"], **launch, PREFETCH=pdl.prefetching(launch, z, w1, w3), E=E,
            PF_CHUNKS=32 * p["num_warps"])
        _down_kernel[(N, triton.cdiv(L, p["down_block_l"]))](
            h, idx, weights, w2, out, I=I, L=L, TOP_K=k, BLOCK_L=p["down_block_l"], BLOCK_I=block_i,
            UNROLL=_unroll(triton.cdiv(I, block_i)), num_warps=p["num_warps"], **launch,
            PREFETCH=pdl.prefetching(launch, z, w2), E=E, K_PAD=triton.next_power_of_2(k),
            PF_CHUNKS=max(1, 32 * p["num_warps"] // triton.next_power_of_2(k)))
    return out


@_selected_experts_op.register_fake
def _(z, idx, weights, w1, w3, w2, beta_gate, beta_up):
    return z.new_empty(idx.shape[0], w1.shape[2])
