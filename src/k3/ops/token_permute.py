"""Moving MoE rows between token order and expert order with gathers in both directions.

`z[token]` and `y[slot]` differentiate through autograd's generic index backward, an accumulating
`index_put_` that sorts its indices first (on an H200, ~18 ms of a 480 ms `small` training step). Here the
layout is known: `order` is a permutation of the N·k (token, choice) slots, so each backward is one gather.
"""
import torch

import k3.ops.slot_sum as slot_sums  # (a module object: slot_sum imports this module too)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """slot[order[i]] = i, computed on the device (no sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def dispatch_rows(z: torch.Tensor, order: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
    """Token rows → expert order: `z[order // k]`. z: [N, L]; order: slots sorted by expert [N·k]; slot: its
    inverse. Backward sums each token's k rows: `grad[slot].view(N, k, L).sum(1)`."""
    return _Dispatch.apply(z, order, slot, k)


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`x[index]` for a permutation `index` whose inverse is given; backward `grad[inverse]`."""
    return _Permute.apply(x, index, inverse)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, order, slot, k):
        ctx.save_for_backward(slot)
        ctx.k = k
        return z[order // k]

    @staticmethod
    def backward(ctx, grad):
        (slot,) = ctx.saved_tensors
        # each token's k rows summed as they are read (one kernel where it runs, else a gather and a sum)
        return slot_sums.slot_sum(grad, slot.view(-1, ctx.k)), None, None, None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, perm, inverse):
        ctx.save_for_backward(inverse)
        return y[perm]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None
