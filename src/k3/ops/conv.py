"""Causal depthwise short convolution with a carried tail (KDA's q/k/v convs), float32 weights and state."""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k3.ops.norm import l2_norm, l2_norm_reference
from k3.ops.triton_dispatch import triton_module, use_triton


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
               doc_ids: torch.Tensor | None = None, silu: bool = False,
               l2_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv: `y[t, c] = Σ_j weight[c, 0, j] · x[t − (W−1) + j, c]`, then SiLU(y) if `silu`
    (KDA's q/k/v; on the kernels' path in the same passes, each way), then with `l2_head` = K (needs `silu`)
    each head of K channels L2-normalised, `l2_norm(SiLU(y))` (KDA's q/k; in the kernels where K divides their
    channel tiles, `l2_fusable`).

    x: [B, T, C]; weight: [C, 1, W]; tail: [B, W−1, C], the previous W−1 inputs (zeros when None).
    doc_ids: [B, T] for packed rows; taps that reach into another document read zero.
    Returns (y [B, T, C] in x's dtype, new tail [B, W−1, C] in the compute dtype).
    For backward only x (in its own dtype), the tail and doc_ids are kept; the fp32 padded input is rebuilt.
    CUDA tensors take the Triton kernels of `k3.ops._conv_triton` (same math, fp32 accumulate; 8x faster than
    this path at `small`'s training shape on an H200) unless K3_NO_TRITON names them; widths up to MAX_TAPS.
    """
    if l2_head is not None and not (silu and l2_head > 0 and x.shape[-1] % l2_head == 0):
        raise ValueError(f"short_conv: l2_head needs silu and a head width dividing the {x.shape[-1]} channels, "
                         f"got l2_head={l2_head}, silu={silu}")
    kernels = triton_module("_conv_triton") if x.numel() and use_triton(x, "_conv_triton") else None
    if kernels is not None and weight.shape[-1] <= kernels.MAX_TAPS:
        if l2_head is None or kernels.l2_fusable(l2_head):
            return kernels.short_conv(x, weight, tail, doc_ids, silu, l2_head)
        y, new_tail = kernels.short_conv(x, weight, tail, doc_ids, silu)
        return _l2_heads(y, l2_head), new_tail
    y, new_tail = _ShortConv.apply(x, weight, tail, doc_ids)
    y = F.silu(y) if silu else y
    return (y if l2_head is None else _l2_heads(y, l2_head)), new_tail


def _l2_heads(y: torch.Tensor, K: int) -> torch.Tensor:
    """Each head of K channels of y [..., C] L2-normalised (k3.ops.norm.l2_norm: KDA's q/k norm, eps 1e-6)."""
    return l2_norm(y.unflatten(-1, (-1, K))).flatten(-2)


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
                         doc_ids: torch.Tensor | None = None, silu: bool = False,
                         l2_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` differentiated by autograd directly (keeps the fp32 padded input): the tests' reference.
    The SiLU is applied to the conv's output in x's dtype, as a separate op would, and the heads' L2 norm (in
    the compute dtype, at least fp32) to that."""
    with torch.autocast(x.device.type, enabled=False):  # SPEC: the conv runs in fp32, also under bf16 autocast
        y, new_tail = _short_conv_fp32(x, weight, tail, doc_ids)
    y = F.silu(y) if silu else y
    if l2_head is not None:
        y = l2_norm_reference(y.unflatten(-1, (-1, l2_head))).flatten(-2)
    return y, new_tail


def _short_conv_fp32(x, weight, tail, doc_ids):
    B, T, C = x.shape
    W = weight.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(dt)
    if tail is None:
        tail = xf.new_zeros(B, W - 1, C)
    xp = torch.cat([tail.to(dt), xf], dim=1)  # [B, T+W-1, C]
    w = weight.to(dt)
    if doc_ids is None:
        y = F.conv1d(xp.transpose(1, 2), w, groups=C).transpose(1, 2)
    else:  # tap j is the padded input shifted by j, zeroed where it reaches into another document
        # (contiguous slices: an einsum over the unfolded [B, T, C, W] window ran ~10x slower on CPU)
        d = F.pad(doc_ids, (W - 1, 0), value=-1)  # [B, T+W-1]
        y = None
        for j in range(W):
            same = (d[:, j:j + T] == doc_ids).to(dt).unsqueeze(-1)  # [B, T, 1]
            tap = xp[:, j:j + T] * w[:, 0, j] * same
            y = tap if y is None else y + tap
    return y.to(x.dtype), xp[:, xp.shape[1] - (W - 1):]


class _ShortConv(torch.autograd.Function):
    """Forward: `short_conv_reference`. Backward: the reference recomputed from the saved inputs and
    differentiated by autograd, so gradients are the reference's own."""

    @staticmethod
    def forward(ctx, x, weight, tail, doc_ids):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, tail, doc_ids)
        y, new_tail = short_conv_reference(x, weight, tail, doc_ids)
        return y, new_tail.clone()  # a copy, so a kept tail does not pin the whole padded input

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_tail):
        x, weight, tail, doc_ids = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        pairs = [(i, g) for i, g in enumerate((grad_y, grad_tail)) if g is not None]
        if not pairs:
            return None, None, None, None
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip((x, weight, tail), need)]
            outs = short_conv_reference(leaves[0], leaves[1], leaves[2], doc_ids)
            grads = list(torch.autograd.grad([outs[i] for i, _ in pairs], [t for t, n in zip(leaves, need) if n],
                                             [g for _, g in pairs], allow_unused=True))
        return *(grads.pop(0) if n else None for n in need), None
