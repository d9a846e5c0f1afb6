"""Triton kernels for the MoE's sum over each token's k expert rows (imported only through
k3.ops.triton_dispatch; needs triton). Formulas and the torch reference: k3.ops.slot_sum.

Forward: each program sums the k rows `y[slot[n, j]]` (weighted by w[n, j] where given) of ROWS tokens over
BLOCK_L columns in fp32, the k rows' loads issued together; it reads y once and writes [N, L]. The torch form
gathers the [N·k, L] rows into a copy first and reads that copy again. Backward: each program takes whole rows
(the weight gradient is a dot product over L): it reads ∂L/∂out of ROWS tokens once, writes ∂L/∂y[slot[n, j]] =
w[n, j] · ∂L/∂out[n] straight into y's expert order (slot is a permutation: every row written once, by one
program) and ⟨∂L/∂out[n], y[slot[n, j]]⟩ for the weights.
"""
import torch
import triton
import triton.language as tl

from k3.ops.triton_dispatch import on_device

FWD_ROWS, FWD_BLOCK_L, BWD_ROWS, NUM_WARPS = 4, 256, 2, 4


@triton.jit
def _slot_sum_fwd_kernel(y_ptr, slot_ptr, w_ptr, out_ptr, N, L, K: tl.constexpr, HAS_W: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_L: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < L)[None, :]
    acc = tl.zeros([ROWS, BLOCK_L], dtype=tl.float32)
    for j in tl.static_range(K):
        src = tl.load(slot_ptr + rows * K + j, mask=row_ok, other=0).to(tl.int64)
        v = tl.load(y_ptr + src[:, None] * L + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + rows * K + j, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * L + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _slot_sum_bwd_kernel(y_ptr, slot_ptr, w_ptr, dout_ptr, dy_ptr, dw_ptr, N, L, K: tl.constexpr,
                         NEED_DY: tl.constexpr, NEED_DW: tl.constexpr, ROWS: tl.constexpr, BLOCK_L: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_L)  # a whole row (BLOCK_L >= L)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < L)[None, :]
    d = tl.load(dout_ptr + rows.to(tl.int64)[:, None] * L + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        src = tl.load(slot_ptr + rows * K + j, mask=row_ok, other=0).to(tl.int64)
        at = src[:, None] * L + cols[None, :]
        if NEED_DY:
            wj = tl.load(w_ptr + rows * K + j, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + at, (wj[:, None] * d).to(dy_ptr.dtype.element_ty), mask=ok)
        if NEED_DW:
            v = tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32)
            tl.store(dw_ptr + rows * K + j, tl.sum(d * v, axis=1).to(dw_ptr.dtype.element_ty), mask=row_ok)


def slot_sum_forward(y: torch.Tensor, slot: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """y [M, L], slot [N, k] (int, rows of y), w [N, k] or None; all contiguous. Returns [N, L] in y's dtype."""
    (N, K), L = slot.shape, y.shape[1]
    out = torch.empty(N, L, device=y.device, dtype=y.dtype)
    block_l = min(FWD_BLOCK_L, triton.next_power_of_2(L))
    with on_device(y):
        _slot_sum_fwd_kernel[(triton.cdiv(N, FWD_ROWS), triton.cdiv(L, block_l))](
            y, slot, y if w is None else w, out, N, L, K=K, HAS_W=w is not None, ROWS=FWD_ROWS, BLOCK_L=block_l,
            num_warps=NUM_WARPS)
    return out


def slot_sum_backward(dout: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, w: torch.Tensor, need_dy: bool,
                      need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(∂L/∂y, ∂L/∂w) of the weighted sum, each where needed. slot must be a permutation of y's rows (every row
    of ∂L/∂y is written by exactly one (token, choice))."""
    (N, K), L = slot.shape, y.shape[1]
    dy = torch.empty_like(y) if need_dy else None
    dw = torch.empty_like(w) if need_dw else None
    with on_device(y):
        _slot_sum_bwd_kernel[(triton.cdiv(N, BWD_ROWS),)](
            y, slot, w, dout, y if dy is None else dy, w if dw is None else dw, N, L, K=K, NEED_DY=need_dy,
            NEED_DW=need_dw, ROWS=BWD_ROWS, BLOCK_L=triton.next_power_of_2(L), num_warps=NUM_WARPS)
    return dy, dw
