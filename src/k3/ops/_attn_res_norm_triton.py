"""The Block AttnRes mix as a layer uses it at inference, in one launch (imported only through
k3.ops.triton_dispatch; needs triton): the residual add before it, the mix, and the RMSNorm after it.

A layer reads a mix only through the norm that follows it (input_layernorm, post_attention_layernorm, the final
norm), and the second mix of a layer reads the partial sum just updated by `p + attn(...)`. So at decode one
program per row tile reads the stored blocks, p and the attention output once, writes p + attn (the next
partial sum) and the normed mix, and nothing else: the mix output, the sum's re-read, the scores and the
log-sum-exp kept for backward are gone. The kernel is `k3.ops._attn_res_triton`'s forward with those parts
switched on (one home for the mix's arithmetic); each rounding of the separate ops is kept (the sum and the mix
are rounded to the model's dtype before they are read on), so it is a reordered fp32 sum away from them.
"""
import torch
import triton

from k3.ops import _pdl_triton as pdl
from k3.ops._attn_res_triton import NUM_WARPS, _blocks, _mix_fwd_kernel
from k3.ops.triton_dispatch import call_op, inference_op, on_device

# max_block_r: rows a program at most (below the mix's own tile, `_attn_res_triton._blocks`: 2 rows of small's 1536
# columns); at a decode batch fewer rows a program means more programs on the SMs and a shorter chain each.
# preload: every source's load issued before the first reduction (`_attn_res_triton._mix_rows`' PRELOAD).
LAUNCH = dict(max_block_r=1, preload=True)


def score_weight(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u ⊙ w in fp32 [D]: the mix's key-norm weight [D] times its pseudo-query [1, D], the one vector the kernel's
    scores read (in bf16 three small launches: two casts and the product; callers that keep it make it once)."""
    return u.float() * w.reshape(-1).float()


def mix_norm_forward(u: torch.Tensor, w: torch.Tensor, eps: float, sources: tuple[torch.Tensor, ...],
                     norm_weight: torch.Tensor, norm_eps: float, add: torch.Tensor | None = None,
                     uw: torch.Tensor | None = None):
    """(RMSNorm(mix(sources with the last one plus `add`)), that last source plus `add`, or None without add).
    u, w: the mix's key-norm weight [D] and pseudo-query [1, D], or `uw`: `score_weight(u, w)` made beforehand;
    sources, add: contiguous [..., D], one dtype. Launches through the custom op `k3::attn_res_mix_norm` (inside
    torch.compile; its function directly elsewhere: k3.ops.triton_dispatch.call_op)."""
    uw = score_weight(u, w) if uw is None else uw
    outs = call_op("attn_res_mix_norm", uw, float(eps), list(sources), norm_weight, float(norm_eps), add)
    return outs[0], (outs[1] if add is not None else None)


# A custom op so that torch.compile keeps the launch as one opaque call (inference only: no autograd formula).
# It returns [y] without add and [y, p + add] with it (an op's outputs cannot be None).
@inference_op("attn_res_mix_norm")
def _mix_norm_op(uw: torch.Tensor, eps: float, sources: list[torch.Tensor],
                 norm_weight: torch.Tensor, norm_eps: float, add: torch.Tensor | None) -> list[torch.Tensor]:
    D = sources[0].shape[-1]
    R = sources[0].numel() // D
    out = torch.empty_like(sources[0])
    total = None if add is None else torch.empty_like(add)
    block_r, block_d = _blocks(D)
    block_r = min(block_r, LAUNCH["max_block_r"])
    with on_device(out):
        _mix_fwd_kernel[(triton.cdiv(R, block_r),)](tuple(sources), uw, out, out, out,
                                                    out if add is None else add, out if total is None else total,
                                                    norm_weight, R, D, eps, norm_eps, N=len(sources),
                                                    STATS=False, ADD=add is not None, NORM=True,
                                                    BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS["fwd"],
                                                    PRELOAD=LAUNCH["preload"], **pdl.launch(out))
    return [out] if total is None else [out, total]


@_mix_norm_op.register_fake
def _(uw, eps, sources, norm_weight, norm_eps, add):
    out = torch.empty_like(sources[0])
    return [out] if add is None else [out, torch.empty_like(add)]
