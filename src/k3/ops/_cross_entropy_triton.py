"""Triton kernels for the training loss's log-sum-exp and its gradient over [N, V] logits (imported only through
k3.ops.triton_dispatch; needs triton). Same contract and math as `k3.ops.cross_entropy.chunked_cross_entropy`.

Forward reads each row of logits once, keeping a running max and sum in fp32 (online log-sum-exp); backward
reads it once more and writes (softmax − onehot(target)) · scale in the logits' dtype. The torch path's chunks
convert to fp32, subtract, exponentiate, scale and convert back, each a pass over the [N, V] block.
"""
import torch
import triton
import triton.language as tl

from k3.ops._math_triton import _exp
from k3.ops.triton_dispatch import on_device

BLOCK_V = 4096  # columns per step of a row's loop (16 fp32 per thread at 8 warps)
_NUM_WARPS = 8


@triton.jit
def _lse_kernel(logits_ptr, lse_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max and sum, combined once at the end
    s = tl.zeros([BLOCK], tl.float32)
    start = 0
    # a while loop: Triton's interpreter (the CPU tests) cannot run a `for` to a runtime bound under numpy 2.4
    while start < V:
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only -inf keep sum 0 (exp(-inf - -inf) would be nan)
        s = tl.where(m_new == float("-inf"), 0.0, s * _exp(m - m_new, False) + _exp(x - m_new, False))
        m = m_new
        start += BLOCK
    m_row = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * _exp(m - m_row, False)), axis=0)
    tl.store(lse_ptr + row, m_row + tl.log(total))


@triton.jit
def _grad_kernel(logits_ptr, grad_ptr, lse_ptr, target_ptr, scale_ptr, V, stride, BLOCK: tl.constexpr):
    """grad[row] = (exp(logits[row] − lse[row]) − onehot(target[row])) · scale[row]."""
    row = tl.program_id(0).to(tl.int64)
    base, out = logits_ptr + row * stride, grad_ptr + row * V
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK)
    start = 0
    while start < V:
        c = start + cols
        ok = c < V
        x = tl.load(base + c, mask=ok, other=0.0).to(tl.float32)
        p = _exp(x - lse, False) - tl.where(c == target, 1.0, 0.0)
        tl.store(out + c, (p * scale).to(grad_ptr.dtype.element_ty), mask=ok)
        start += BLOCK


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """logits with unit column stride (rows may be strided, as in a sliced batch)."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


def log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [N] log Σ_v exp(logits[n, v]) of [N, V] bf16/fp16/fp32 logits (N, V > 0)."""
    logits = _rows(logits)
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    with on_device(logits):
        _lse_kernel[(N,)](logits, lse, V, logits.stride(0), BLOCK=BLOCK_V, num_warps=_NUM_WARPS)
    return lse


def softmax_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                         row_scale: torch.Tensor) -> torch.Tensor:
    """(softmax(logits) − onehot(target)) · row_scale[:, None] in the logits' dtype, [N, V] contiguous;
    lse, row_scale fp32 [N], target int64 [N] within [0, V)."""
    logits = _rows(logits)
    N, V = logits.shape
    grad = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    with on_device(logits):
        _grad_kernel[(N,)](logits, grad, lse.contiguous(), target.contiguous(), row_scale.contiguous(), V,
                           logits.stride(0), BLOCK=BLOCK_V, num_warps=_NUM_WARPS)
    return grad
