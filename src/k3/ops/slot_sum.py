"""The MoE's sum over each token's k expert rows: out[n] = Σ_j w[n, j] · y[slot[n, j]] (w = 1 where not given),
as the torch reference and as one Triton kernel each way (k3.ops._slot_sum_triton).

Two uses in training: the routed experts' combine (y: the experts' outputs in expert order, slot: where each
(token, choice) sits there, w: the routing weights), and the backward of the dispatch gather `z[order // k]`
(y: its gradient, no weights). The torch form first gathers the [N·k, L] rows into a copy (`y[slot]`), then a
batched [1, k] @ [k, L] product or a sum reads that copy again; its backward writes the copy's gradient and
gathers it back into expert order. The kernels read y once and write ∂L/∂y in expert order directly.

Gradients: ∂L/∂y[slot[n, j]] = w[n, j] · ∂L/∂out[n]; ∂L/∂w[n, j] = ⟨∂L/∂out[n], y[slot[n, j]]⟩.
"""
import torch
from torch.autograd.function import once_differentiable

import k3.ops.token_permute as token_permute  # (a module object: token_permute may import this one)
from k3.ops.triton_dispatch import triton_module, use_triton


def slot_sum_reference(y: torch.Tensor, slot: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """y: [M, L]; slot: [N, k] int rows of y; w: [N, k] or None. Returns [N, L] in y's dtype (torch's sum and
    batched product accumulate bf16 in fp32 and round once, as the kernels do)."""
    rows = y[slot]  # [N, k, L]
    return rows.sum(1) if w is None else torch.bmm(w.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def slot_sum(y: torch.Tensor, slot: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """`slot_sum_reference` in one kernel each way where the Triton kernels run (CUDA, a float dtype). Where y
    needs a gradient, slot must be a permutation of y's rows (N · k == M: the MoE's slots), which is checked
    by shape only."""
    N, k = slot.shape
    if y.numel() and use_triton(y, "_slot_sum_triton") and (not y.requires_grad or y.shape[0] == N * k):
        return _slot_sum_kernels(y, slot, w)
    return slot_sum_reference(y, slot, w)


def combine_rows(y: torch.Tensor, w: torch.Tensor, slot: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The MoE's combine r[n] = Σ_j w[n, j] · y[slot[n·k + j]]: y [N·k, L] in expert order, w [N, k], slot the
    flat inverse of `order` (the (token, choice) slots sorted by expert); w may be fp32 beside a bf16 y (the
    kernels read it as it is, ∂L/∂w in its dtype). The kernels where they run; else the
    gather through k3.ops.token_permute (its backward one gather, not autograd's sorting index_put_) and a
    batched [1, k] @ [k, L] product."""
    N, k = w.shape
    if y.numel() and use_triton(y, "_slot_sum_triton") and y.shape[0] == N * k:
        return _slot_sum_kernels(y, slot.view(N, k), w)
    return torch.bmm(w.to(y.dtype).unsqueeze(1), token_permute.permute_rows(y, slot, order).view(N, k, -1)).squeeze(1)


def _slot_sum_kernels(y, slot, w):
    """The kernels: through `_SlotSum` where a gradient is wanted, else the forward kernel alone (an
    autograd.Function's apply costs ~40 µs of host time a call on the H200's host even under inference mode, issue
    21, and records nothing there)."""
    if torch.is_grad_enabled() and (y.requires_grad or (w is not None and w.requires_grad)):
        return _SlotSum.apply(y, slot, w)
    return _forward(y.contiguous(), slot.contiguous(), None if w is None else w.contiguous())


def _forward(y, slot, w):
    return triton_module("_slot_sum_triton").slot_sum_forward(y, slot, w)


class _SlotSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, slot, w):
        y, slot = y.contiguous(), slot.contiguous()
        w = None if w is None else w.contiguous()
        ctx.save_for_backward(y, slot, w)
        return _forward(y, slot, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, slot, w = ctx.saved_tensors
        need_dy, _, need_dw = ctx.needs_input_grad
        if w is None:  # unit weights: the weights' kernel path with ones (no weight gradient)
            w = torch.ones(slot.shape, device=y.device, dtype=y.dtype)
            need_dw = False
        dy, dw = triton_module("_slot_sum_triton").slot_sum_backward(grad.contiguous(), y, slot, w, need_dy,
                                                                     need_dw)
        return dy, None, dw
