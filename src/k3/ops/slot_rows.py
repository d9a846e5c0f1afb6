"""A step's rows of a slot pool: `gather_slots` reads pool[slots], `scatter_slots_` writes rows back there (the
serving pool's KDA states and short-conv tails, one slot per sequence).

`count` (a device int scalar, or None for all rows) is how many leading rows the step really has: a CUDA graph is
captured over a fixed number of rows (k3.serve.runner.StaticKDAView: the step's rows, a pad document, then empty
documents on the scratch slot), and the kernels (k3.ops._slot_rows_triton) move only the rows before `count`. Rows
at and past it are unspecified in a gather and not written by a scatter in the kernels; the torch references
move every row (those rows name the scratch slot, whose contents nothing reads), so both agree on every real row
and slot. References: plain indexing, never dispatching.
"""
import torch

from k3.ops.triton_dispatch import triton_module, use_triton

KERNELS = "_slot_rows_triton"


def gather_slots_reference(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return pool[slots]


def scatter_slots_reference_(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    pool[slots] = rows.to(pool.dtype)


def gather_slots(pool: torch.Tensor, slots: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """pool [P, ...] → [S, ...] = pool[slots] (rows from `count` on unspecified where the kernel runs)."""
    if not _kernel_takes(pool):
        return gather_slots_reference(pool, slots)
    out = pool.new_empty(slots.shape[0], *pool.shape[1:])
    triton_module(KERNELS).move_rows(pool.view(pool.shape[0], -1), out.view(out.shape[0], -1), slots, count,
                                     to_pool=False)
    return out


def scatter_slots_(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                   count: torch.Tensor | None = None) -> None:
    """pool[slots] = rows (in pool's dtype); rows from `count` on not written where the kernel runs."""
    if not _kernel_takes(pool):
        return scatter_slots_reference_(pool, slots, rows)
    rows = rows.reshape(rows.shape[0], -1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    triton_module(KERNELS).move_rows(pool.view(pool.shape[0], -1), rows, slots, count, to_pool=True)


def _kernel_takes(pool: torch.Tensor) -> bool:
    return pool.is_contiguous() and use_triton(pool, KERNELS)
