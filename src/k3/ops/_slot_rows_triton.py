"""Triton kernels for moving whole state rows between a slot pool and a step's rows (imported only through
k3.ops.triton_dispatch; needs triton). Semantics and the torch reference: k3.ops.slot_rows.

Each program copies BLOCK elements of one row, vectorised (a slot's row is contiguous: a KDA state is
H·K·V fp32 values, 768 KiB at 12 heads of 128), and reads the step's row count from the device first: programs of
rows at and past it return at once, so a CUDA graph captured over a fixed number of rows moves only the rows the
replayed step has. torch's `pool[slots] = rows` (index_put) computes an offset per element and moved ~1.5 TB/s
on an H200 where a copy moves ~4.
"""
import torch
import triton
import triton.language as tl

from k3.ops.triton_dispatch import on_device

BLOCK, NUM_WARPS = 4096, 8


@triton.jit
def _slot_rows_kernel(pool_ptr, rows_ptr, slots_ptr, count_ptr, R, pool_stride, rows_stride,
                      TO_POOL: tl.constexpr, HAS_COUNT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_COUNT:
        if i >= tl.load(count_ptr):
            return
    slot = tl.load(slots_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < R
    at_pool = pool_ptr + slot * pool_stride + cols
    at_rows = rows_ptr + i.to(tl.int64) * rows_stride + cols
    if TO_POOL:
        tl.store(at_pool, tl.load(at_rows, mask=ok).to(pool_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(at_rows, tl.load(at_pool, mask=ok).to(rows_ptr.dtype.element_ty), mask=ok)


def move_rows(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, count: torch.Tensor | None,
              to_pool: bool) -> None:
    """pool [P, R] and rows [S, R] (each row contiguous), slots [S] int: rows[i] → pool[slots[i]] (to_pool) or
    back, for i < count (a device int scalar; None: all S)."""
    S, R = rows.shape
    if S == 0 or R == 0:
        return
    grid = (S, triton.cdiv(R, BLOCK))
    with on_device(pool):
        _slot_rows_kernel[grid](pool, rows, slots, slots if count is None else count, R, pool.stride(0),
                                rows.stride(0), TO_POOL=to_pool, HAS_COUNT=count is not None, BLOCK=BLOCK,
                                num_warps=NUM_WARPS)
