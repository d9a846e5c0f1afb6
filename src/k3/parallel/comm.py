"""Autograd-aware collectives (forward and backward are both collectives) built on the APIs shared by
torch 2.11 and 2.13: all_to_all_single, all_gather_into_tensor, reduce_scatter_tensor.

Every rank of the group must call each of these, and, because the backward is a collective too, every
rank's result must reach its loss (use the whole gathered tensor, even if only to index zeros out of it),
or the ranks whose autograd skips the node leave the others waiting.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# torch 2.13 nudges towards all_gather_single, which torch 2.11 lacks; the shared API is the one used here
warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group, pending)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group, None), None, None, None, None


def _exchange(x, out_splits, in_splits, group, pending: list | None):
    """all_to_all_single into a new tensor; with `pending` (a list) it is launched async and its work appended."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                  async_op=pending is not None)
    if pending is not None:
        pending.append(work)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None,
               pending: list | None = None) -> torch.Tensor:
    """Rows of x: [sum(in_splits), ...] go in_splits[j] to rank j; returns [sum(out_splits), ...] (by source).

    pending: a list to launch the exchange asynchronously: its work handle is appended, and the result must not
    be read before `work.wait()` (on a GPU that orders the current stream after the exchange without blocking
    the host), so the caller can queue compute that overlaps the transfer in between."""
    if not x.requires_grad:
        return _exchange(x, out_splits, in_splits, group, pending)
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, pending)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty(n * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        mine = grad.new_empty(grad.shape[0] // n, *grad.shape[1:])
        # every rank's use of my rows contributes to my gradient: sum them here
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """x: [n, ...] on each of R ranks → [R·n, ...] in rank order; the backward sums the ranks' gradients."""
    if not x.requires_grad:
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out
    return _AllGather.apply(x, group)
