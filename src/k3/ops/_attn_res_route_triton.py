"""A MoE layer's second AttnRes mix and its router in one launch, at inference (imported only through
k3.ops.triton_dispatch; needs triton). The contract and selector are `k3.model.attn_res.attn_res_mix_norm_route`.

At decode the mix before a MoE layer's FFN (`p + attn`, the mix, post_attention_layernorm:
k3.ops._attn_res_norm_triton) and the router (k3.ops._router_triton) are two small launches in a row, each a
chain of dependent loads and reductions on a few SMs; the router reads nothing but the mix's output and its own
weight. Here program (row, block of experts) loads its router weight rows first (they depend on nothing), forms
the row's mix + norm itself (`_attn_res_triton._mix_rows`: the row's sources are a few KB, read by each of the
row's few programs), rounds it to the model's dtype as the stored output (what the router would read), and takes
its experts' sigmoid scores from it; the row's first program stores the mix and p + attn, and its last (an atomic
ticket) selects the top k (`_router_triton._select_when_last`: the same rule and ties). One launch where there
were two; each row's mix is computed by each of its cdiv(E, BLOCK_E) programs (8 at small's 64 experts).
"""
import torch
import triton
import triton.language as tl

from k3.ops import _pdl_triton as pdl
from k3.ops._attn_res_triton import _mix_rows
from k3.ops._pdl_triton import pdl_enter
from k3.ops._router_triton import LAUNCH as ROUTER_LAUNCH
from k3.ops._router_triton import _select_when_last
from k3.ops.triton_dispatch import inference_op, on_device

# Elements of a program's router weight tile [BLOCK_E, BLOCK_D] a warp, held in fp32 registers (the router kernel's
# 8 x 2048 at 4 warps); D is one tile (the mix needs the whole row), so wider rows take fewer experts a program.
TILE_ELEMS_PER_WARP = 8 * 2048 // 4
# Programs a row at most: each forms the row's mix again, so many experts over few programs, or none fused.
MAX_PROGRAMS_PER_ROW = 16
# block_e: experts a program (at most; see TILE_ELEMS_PER_WARP); num_warps: the program's warps.
# weights_first: a program loads its router weight tile before it forms the mix (in flight meanwhile, and before
# PDL's wait), at the cost of holding the tile in registers across the mix (ptxas for sm_90 at small's shapes, 5
# sources: 197 registers, 2 CTAs an SM; loaded after the mix, from L2 where every row's programs share it: 118);
# at batch 64 the H100 ran 512 programs of 178 registers in 1.29 waves (benchmarks/ncu_decode.py, session 37).
# preload: the mix's sources loaded at once (`_attn_res_triton._mix_rows`' PRELOAD).
LAUNCH = dict(block_e=8, num_warps=4, weights_first=True, preload=False)


def blocks(D: int, E: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_E) of the launch for width D and E experts."""
    block_d = triton.next_power_of_2(D)
    budget = TILE_ELEMS_PER_WARP * LAUNCH["num_warps"] // block_d
    block_e = max(1, min(LAUNCH["block_e"], budget, triton.next_power_of_2(E)))
    return block_d, block_e


def fits(D: int, E: int) -> bool:
    """Whether the one launch takes this width and expert count: at most MAX_PROGRAMS_PER_ROW programs a row."""
    block_d, block_e = blocks(D, E)
    return triton.cdiv(E, block_e) <= MAX_PROGRAMS_PER_ROW


@triton.jit
def _mix_norm_route_kernel(srcs, uw_ptr, add_ptr, sum_ptr, nw_ptr, y_ptr, rw_ptr, bias_ptr, scores_ptr,
                           tickets_ptr, idx_ptr, wt_ptr, R, D, E, eps, norm_eps, scale, N: tl.constexpr,
                           ADD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                           RENORMALIZE: tl.constexpr, RANK_SELECT: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_D: tl.constexpr, WEIGHTS_FIRST: tl.constexpr = True, PRELOAD: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    n = tl.program_id(0)
    first = tl.program_id(1) == 0
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w_ptrs = rw_ptr + experts.to(tl.int64)[:, None] * D + cols[None, :]
    w_mask = (experts < E)[:, None] & col_ok[None, :]
    if WEIGHTS_FIRST:  # no earlier kernel writes them (so before PDL's wait too)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    rows = n + tl.arange(0, 1)
    mask = (rows < R)[:, None] & col_ok[None, :]
    y = _mix_rows(srcs, uw_ptr, uw_ptr, uw_ptr, add_ptr, sum_ptr, nw_ptr, rows, cols, R, D, eps, norm_eps,
                  mask & first, N, False, ADD, True, y_ptr.dtype.element_ty, PRELOAD).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], y, mask=mask & first)
    if not WEIGHTS_FIRST:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    # the router reads the mix as stored, in the model's dtype (as the separate kernels would hand it over)
    score = tl.sigmoid(tl.sum(w * y.to(tl.float32), axis=1))
    _select_when_last(score, experts, n.to(tl.int64), scores_ptr, bias_ptr, tickets_ptr, idx_ptr, wt_ptr, E, scale,
                      TOP_K, K_PAD, E_PAD, RENORMALIZE, RANK_SELECT)


# A custom op so that torch.compile keeps the launch as one opaque call (inference only). Outputs: (y, idx, weights,
# scores, p + add), the last empty without add (an op's outputs cannot be None; a mutating op's cannot be a list).
# The ticket workspace is declared written: the kernel's atomics write it, though they leave it zero.
@inference_op("attn_res_mix_norm_route", mutates_args=("tickets",))
def mix_norm_route(uw: torch.Tensor, eps: float, sources: list[torch.Tensor], norm_weight: torch.Tensor,
                   norm_eps: float, add: torch.Tensor | None, router_weight: torch.Tensor, bias: torch.Tensor,
                   tickets: torch.Tensor, k: int, renormalize: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm(mix(sources with the last one plus `add`)) and the MoE router's (idx [R, k] int64, weights [R, k]
    fp32, scores [R, E] fp32) of it, for contiguous sources (and add) [..., D] of one dtype, `uw` = u ⊙ w in fp32
    [D], router_weight [E, D] contiguous, bias [E], tickets int32 zeros of at least R entries (left zero)."""
    D = sources[0].shape[-1]
    R = sources[0].numel() // D
    E = router_weight.shape[0]
    y = torch.empty_like(sources[0])
    total = y.new_empty(0) if add is None else torch.empty_like(add)
    scores = torch.empty(R, E, dtype=torch.float32, device=y.device)
    idx = torch.empty(R, k, dtype=torch.int64, device=y.device)
    w = torch.empty(R, k, dtype=torch.float32, device=y.device)
    block_d, block_e = blocks(D, E)
    if R:
        with on_device(y):
            _mix_norm_route_kernel[(R, triton.cdiv(E, block_e))](
                tuple(sources), uw, y if add is None else add, y if add is None else total, norm_weight, y,
                router_weight, bias, scores, tickets, idx, w, R, D, E, eps, norm_eps, scale, N=len(sources),
                ADD=add is not None, TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(E),
                RENORMALIZE=renormalize, RANK_SELECT=E <= ROUTER_LAUNCH["rank_select_max_experts"],
                BLOCK_E=block_e, BLOCK_D=block_d, WEIGHTS_FIRST=LAUNCH["weights_first"], PRELOAD=LAUNCH["preload"],
                num_warps=LAUNCH["num_warps"], **pdl.launch(y))
    return y, idx, w, scores, total


@mix_norm_route.register_fake
def _(uw, eps, sources, norm_weight, norm_eps, add, router_weight, bias, tickets, k, renormalize, scale):
    R = sources[0].numel() // sources[0].shape[-1]
    y = torch.empty_like(sources[0])
    return (y, y.new_empty(R, k, dtype=torch.int64), y.new_empty(R, k, dtype=torch.float32),
            y.new_empty(R, router_weight.shape[0], dtype=torch.float32),
            y.new_empty(0) if add is None else torch.empty_like(add))
