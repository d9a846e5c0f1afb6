"""Triton kernel for the MoE router at decode (imported only through k3.ops.triton_dispatch; needs triton).

One launch from the hidden states x [N, D] and the router weight [E, D], both read as stored (bf16, fp16 or
fp32) and multiplied in fp32 registers, to each row's top-k expert ids and their weights. Program (row, block of
experts) forms its experts' sigmoid scores and writes them to an fp32 scratch row; the last program of a row to
finish (an atomic ticket per row) reads the row's scores back and selects by the rule of k3.ops.router.route
(largest score + bias first, lower id among equals): for up to 128 experts every expert's place in that order at
once (the experts ahead of it), beyond that k rounds of "the largest free key"; then the chosen unbiased scores
renormalised and scaled. That program also sets the row's ticket back to zero, so the workspace stays zero between
launches and a CUDA graph replays it as captured; two launches sharing one workspace must not run at the same time.
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._pdl_triton import pdl_enter, prefetch_rows_l2
from k3.ops.triton_dispatch import call_op, inference_op, on_device


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, scores_ptr, tickets_ptr, idx_ptr, wt_ptr, E, D, scale,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                   RANK_SELECT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, PF_CHUNKS: tl.constexpr = 1):
    n = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < E
    if PREFETCH and n == 0:  # its experts' weight rows into L2, once (the first row's programs)
        prefetch_rows_l2(w_ptr + experts.to(tl.int64) * D, e_ok, D, PF_CHUNKS)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    d0 = 0
    while d0 < D:  # not `for ... range(D)`: Triton's interpreter (the CPU tests) needs a constant bound there
        cols = d0 + tl.arange(0, BLOCK_D)
        c_ok = cols < D
        x = tl.load(x_ptr + n * D + cols, mask=c_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts.to(tl.int64)[:, None] * D + cols[None, :], mask=e_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
        d0 += BLOCK_D
    score = tl.sigmoid(tl.sum(acc, axis=1))
    _select_when_last(score, experts, n, scores_ptr, bias_ptr, tickets_ptr, idx_ptr, wt_ptr, E, scale, TOP_K, K_PAD,
                      E_PAD, RENORMALIZE, RANK_SELECT)


@triton.jit
def _select_when_last(score, experts, n, scores_ptr, bias_ptr, tickets_ptr, idx_ptr, wt_ptr, E, scale,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                      RANK_SELECT: tl.constexpr):
    """Stores this program's scores of row n's `experts` and draws the row's ticket; the row's last program (of
    the grid's axis 1) selects its top k from all the row's scores (the module docstring), stores the ids and
    weights, and sets the ticket back to zero."""
    tl.store(scores_ptr + n * E + experts, score, mask=experts < E)
    # every thread's score stores precede the ticket (the barrier), and the ticket releases them to the program
    # that draws the last one (its acquire)
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + n, 1, sem="acq_rel")
    if ticket == tl.num_programs(1) - 1:
        ids = tl.arange(0, E_PAD)
        valid = ids < E
        # .cg: from L2, where the other programs' stores are; never a stale line of this SM's L1
        s = tl.load(scores_ptr + n * E + ids, mask=valid, other=0.0, cache_modifier=".cg")
        key = s + tl.load(bias_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        slots = tl.arange(0, K_PAD)
        if RANK_SELECT:
            # every expert's place in the order (key descending, lower id first among equals) at once: the
            # experts ahead of it. A NaN key counts as -inf, so the places are a permutation of 0..E-1.
            key = tl.where((key == key) & valid, key, float("-inf"))
            ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (ids[None, :] < ids[:, None]))
            place = tl.sum((ahead & valid[None, :]).to(tl.int32), axis=1)  # [E_PAD]
            chosen = (place[None, :] == slots[:, None]) & valid[None, :]  # [K_PAD, E_PAD]: one id a slot
            picked = tl.sum(tl.where(chosen, ids[None, :], 0), axis=1).to(tl.int64)
            weight = tl.sum(tl.where(chosen, s[None, :], 0.0), axis=1)
        else:  # many experts (an [E, E] comparison would not fit): k rounds of the largest free key
            free = valid
            picked = tl.zeros([K_PAD], tl.int64)
            weight = tl.zeros([K_PAD], tl.float32)
            for j in tl.static_range(TOP_K):
                best = tl.max(tl.where(free, key, float("-inf")), axis=0)
                # the lowest free id holding the best key (a NaN key matches nothing: clamp to a valid id)
                pick = tl.minimum(tl.min(tl.where(free & (key == best), ids, E_PAD), axis=0), E - 1)
                hit = ids == pick
                picked = tl.where(slots == j, pick.to(tl.int64), picked)
                weight = tl.where(slots == j, tl.sum(tl.where(hit, s, 0.0), axis=0), weight)
                free = free & ~hit
        if RENORMALIZE:
            weight = weight / tl.sum(tl.where(slots < TOP_K, weight, 0.0), axis=0)
        out = n * TOP_K + slots
        tl.store(idx_ptr + out, picked, mask=slots < TOP_K)
        tl.store(wt_ptr + out, weight * scale, mask=slots < TOP_K)
        tl.store(tickets_ptr + n, 0)


# Experts per program, the width of each step along D (2048: small's D = 1536 in one step, whose loads are all in
# flight at once), and the most experts selected by places (an [E, E] comparison in the last program: 4 rounds of
# reductions instead of 3 a choice); names, so that a launch sweep can time others. H200, session 26
# (`bench_gpu_kernels.py --decode-sweep`, small's router from L2-cold copies, µs at 1 / 8 / 64 rows): this launch
# 4.35 / 4.93 / 8.47; 4 experts a program 5.44 / 5.85 / 10.3; 2 experts 5.42 / 5.80 / 10.4; steps of 512 along D
# (the launch before) 9.24 / 10.4 / 11.6; k rounds instead of places (4 experts) 6.98 / 7.00 / 10.6.
LAUNCH = dict(block_e=8, block_d=2048, num_warps=4, rank_select_max_experts=128)


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool,
                 scale: float, tickets: torch.Tensor | None = None):
    """Same contract as k3.ops.router.route_tokens: (idx [N, k] int64, weights [N, k] fp32, scores [N, E] fp32).
    Checks its inputs, then launches through the custom op `k3::route_tokens_decode` (inside torch.compile; its
    function directly elsewhere: k3.ops.triton_dispatch.call_op)."""
    N, D = x.shape
    E = weight.shape[0]
    if not 1 <= k <= E:
        raise ValueError(f"top_k must lie in [1, num_experts={E}], got {k}")
    if tickets is None:
        tickets = torch.zeros(N, dtype=torch.int32, device=x.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < N or tickets.device != x.device:
        raise ValueError(f"tickets must be int32 zeros on {x.device} with at least {N} entries, got "
                         f"{tickets.dtype} [{tickets.numel()}] on {tickets.device}")
    return tuple(call_op("route_tokens_decode", x.contiguous(), weight.contiguous(), bias.contiguous(), tickets, k,
                         renormalize, float(scale)))


# A custom op so that torch.compile keeps the launch as one opaque call (Dynamo cannot trace a Triton launch on
# the interpreter, and inductor would not fuse this selection). The workspace is declared written: the kernel's
# atomics do write it, even though they leave it zero.
@inference_op("route_tokens_decode", mutates_args=("tickets",))
def _route_tokens_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tickets: torch.Tensor, k: int,
                     renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch, on inputs `route_tokens` checked (x, weight and bias contiguous)."""
    N, D = x.shape
    E = weight.shape[0]
    scores = torch.empty(N, E, dtype=torch.float32, device=x.device)
    idx = torch.empty(N, k, dtype=torch.int64, device=x.device)
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    block_e = min(LAUNCH["block_e"], triton.next_power_of_2(E))
    block_d = min(LAUNCH["block_d"], triton.next_power_of_2(D))
    launch = pdl.launch(x)
    prefetch = dict(PREFETCH=pdl.prefetching(launch, x, weight),
                    PF_CHUNKS=max(1, 32 * LAUNCH["num_warps"] // block_e))
    if N:
        with on_device(x):
            _router_kernel[(N, triton.cdiv(E, block_e))](
                x, weight, bias, scores, tickets, idx, w, E, D, scale,
                TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E), RENORMALIZE=renormalize,
                RANK_SELECT=E <= LAUNCH["rank_select_max_experts"], BLOCK_E=block_e, BLOCK_D=block_d,
                num_warps=LAUNCH["num_warps"], **prefetch, **launch)
    return idx, w, scores


@_route_tokens_op.register_fake
def _(x, weight, bias, tickets, k, renormalize, scale):
    N, E = x.shape[0], weight.shape[0]
    return (x.new_empty(N, k, dtype=torch.int64), x.new_empty(N, k, dtype=torch.float32),
            x.new_empty(N, E, dtype=torch.float32))
