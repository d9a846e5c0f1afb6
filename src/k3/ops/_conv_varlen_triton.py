"""KDA's q, k, v short convs over a serving step's packed sequences as one Triton kernel (imported only through
k3.ops.triton_dispatch; needs triton).

Same contract and math as `k3.model.kda.short_conv_varlen` followed by the SiLU and the split into q, k, v:
S sequences flattened into one row of N tokens, each continuing from its own tail of W − 1 inputs; channels are
the three parts side by side ([N, 3C]). A token's tap reads x where it falls inside its sequence's new tokens and
the sequence's tail before them; fp32 sums, SiLU, stored as [3, N, C] (each part a dense block, as the core reads
it). The torch path gathers every window into an fp32 [N, W, 3C] copy, transposes it and sums it with a batched
GEMV (4,608 of [N, 4] @ [4, 1] in `small`: on an H200 ~5 ms of a 2,048-token step's ~25 ms of kernels); this
reads x once, in [BLOCK_T, BLOCK_C] tiles whose W − 1 halo rows are re-read per tap (from cache).
The new tails (each sequence's last W − 1 inputs, fp32) come from a second, small kernel.
"""
import torch
import triton
import triton.language as tl

from k3.ops._math_triton import _sigmoid_pair
from k3.ops.triton_dispatch import on_device

BLOCK_T = 32
BLOCK_C = 128
NUM_WARPS = 4


@triton.jit
def _inputs(x_ptr, tail_ptr, src, seq, start, cols, mask, stride_x, stride_ts, stride_tw, W: tl.constexpr):
    """fp32 [rows, BLOCK_C]: input position `src` of sequence `seq` (whose new tokens start at row `start` of x):
    x's row where src >= start, else row (W − 1) + src − start of the sequence's tail."""
    in_x = src >= start
    xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask & in_x[:, None], other=0.0)
    t_row = (W - 1) + src - start
    tv = tl.load(tail_ptr + seq.to(tl.int64)[:, None] * stride_ts + t_row[:, None] * stride_tw + cols[None, :],
                 mask=mask & (~in_x)[:, None], other=0.0)
    return xv.to(tl.float32) + tv.to(tl.float32)


@triton.jit
def conv_varlen_fwd_kernel(x_ptr, w_ptr, tail_ptr, seg_ptr, cu_ptr, y_ptr, N, C3, C, stride_x, stride_ts,
                           stride_tw, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < N, cols < C3
    mask = rmask[:, None] & cmask[None, :]
    seq = tl.load(seg_ptr + rows, mask=rmask, other=0)
    start = tl.load(cu_ptr + seq, mask=rmask, other=0).to(tl.int32)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += _inputs(x_ptr, tail_ptr, rows - (W - 1) + j, seq, start, cols, mask, stride_x, stride_ts,
                       stride_tw, W) * w[None, :]
    y = acc * _sigmoid_pair(acc, False)[0]  # SiLU (the training conv's form)
    part, col = cols // C, cols % C  # [3, N, C]: q, k, v each a dense block
    out = part.to(tl.int64)[None, :] * N * C + rows.to(tl.int64)[:, None] * C + col[None, :]
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def conv_varlen_tails_kernel(x_ptr, tail_ptr, cu_ptr, new_ptr, C3, stride_x, stride_ts, stride_tw,
                             W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_W)
    start = tl.load(cu_ptr + s).to(tl.int32)
    end = tl.load(cu_ptr + s + 1).to(tl.int32)
    seq = tl.zeros([BLOCK_W], dtype=tl.int32) + s
    mask = (i < W - 1)[:, None] & (cols < C3)[None, :]
    v = _inputs(x_ptr, tail_ptr, end - (W - 1) + i, seq, start, cols, mask, stride_x, stride_ts, stride_tw, W)
    tl.store(new_ptr + s.to(tl.int64) * (W - 1) * C3 + i[:, None] * C3 + cols[None, :], v, mask=mask)


def short_convs_varlen(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, cu_seqlens: torch.Tensor,
                       seg: torch.Tensor, parts: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, P·C] (rows may be strided, channels contiguous); weight [P·C, 1, W] fp32; tails [S, W − 1, P·C]
    (channels contiguous); cu_seqlens [S + 1] int64 and seg [N] int32 (each token's sequence) on x's device.
    Returns (SiLU(conv) [P, N, C] in x's dtype, new tails [S, W − 1, P·C] fp32)."""
    N, C3 = x.shape
    S, W = tails.shape[0], weight.shape[-1]
    if x.stride(1) != 1 or tails.stride(2) != 1:
        raise ValueError("x and tails need contiguous channels")
    w = weight.reshape(C3, W).contiguous()
    y = torch.empty(parts, N, C3 // parts, device=x.device, dtype=x.dtype)
    new = torch.empty(S, W - 1, C3, device=x.device, dtype=torch.float32)
    with on_device(x):
        conv_varlen_fwd_kernel[(triton.cdiv(N, BLOCK_T), triton.cdiv(C3, BLOCK_C))](
            x, w, tails, seg, cu_seqlens, y, N, C3, C3 // parts, x.stride(0), tails.stride(0), tails.stride(1),
            W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
        conv_varlen_tails_kernel[(S, triton.cdiv(C3, BLOCK_C))](
            x, tails, cu_seqlens, new, C3, x.stride(0), tails.stride(0), tails.stride(1), W=W,
            BLOCK_W=triton.next_power_of_2(max(W - 1, 1)), BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return y, new
