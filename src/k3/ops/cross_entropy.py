"""Mean token cross entropy over [N, V] logits without an fp32 copy of them (the training loss)."""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k3.ops.triton_dispatch import triton_module, use_triton

CHUNK_ELEMENTS = 1 << 26  # fp32 working set of one row chunk: 256 MiB


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)` (float64 stays float64).
    logits: [N, V]; labels: [N] int. On CUDA through `chunked_cross_entropy` (memory is what runs short
    there); elsewhere torch's fused kernel, which is faster on CPU."""
    if logits.is_cuda:
        return chunked_cross_entropy(logits, labels, ignore_index)
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(dt), labels, ignore_index=ignore_index)


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The same loss with the math in fp32 one row chunk at a time; backward keeps only the logits themselves
    and one log-sum-exp per row, where F.cross_entropy keeps [N, V] fp32 log-probabilities. On CUDA (bf16/fp16/
    fp32 logits) both passes are k3.ops._cross_entropy_triton's kernels: one read of the logits forward, one read
    and one write backward, instead of a conversion, subtraction, exp and scaling pass per chunk."""
    return _CrossEntropy.apply(logits, labels, ignore_index)


def _fused(logits: torch.Tensor) -> bool:
    """Whether the loss takes the Triton kernels: where use_triton says so, and logits that are not empty."""
    return logits.numel() > 0 and use_triton(logits, "_cross_entropy_triton")


def _row_chunks(logits: torch.Tensor):
    rows = max(1, CHUNK_ELEMENTS // max(logits.shape[1], 1))
    return range(0, logits.shape[0], rows), rows


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        valid = labels != ignore_index
        target = torch.where(valid, labels, 0).long()
        if _fused(logits):
            lse = triton_module("_cross_entropy_triton").log_sum_exp(logits)
        else:
            lse = torch.empty(logits.shape[0], dtype=dt, device=logits.device)
            starts, rows = _row_chunks(logits)
            for s in starts:
                lse[s:s + rows] = torch.logsumexp(logits[s:s + rows].to(dt), dim=-1)
        picked = logits.gather(1, target[:, None])[:, 0].to(dt)
        count = valid.sum()
        loss = torch.where(valid, lse - picked, 0).sum() / count  # no valid token: 0/0 = nan, like F.cross_entropy
        ctx.save_for_backward(logits, target, valid, lse, count)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        logits, target, valid, lse, count = ctx.saved_tensors
        # ∂loss/∂logits = (softmax − onehot(target)) · g / count on valid rows, zero on ignored ones
        row_scale = torch.where(valid, grad_loss.to(lse.dtype) / count, 0)
        if _fused(logits):
            return triton_module("_cross_entropy_triton").softmax_minus_onehot(logits, lse, target, row_scale), \
                None, None
        grad = torch.empty_like(logits)
        starts, rows = _row_chunks(logits)
        for s in starts:
            e = min(s + rows, logits.shape[0])
            p = torch.exp(logits[s:e].to(lse.dtype) - lse[s:e, None])
            p.scatter_add_(1, target[s:e, None], p.new_full((e - s, 1), -1.0))
            grad[s:e] = (p * row_scale[s:e, None]).to(logits.dtype)
        return grad, None, None
