"""Programmatic dependent launch (PDL, Hopper and later) for decode's Triton kernels (imported only through the
kernel modules; needs triton). Switch: K3_PDL (k3.envs), off: slower on an H200 (k3.envs says by how much).

A decode step is ~190 kernels of a few µs each, one after another in one stream, and each pays its launch and its
first loads' latency after the kernel before it has finished. Launched with PDL (`launch_pdl`), a kernel may start
as soon as every program of the kernel before it has let it (`griddepcontrol.launch_dependents`) or exited. Each
of k3's PDL kernels opens with `pdl_enter`:
1. before the wait, it may only prefetch into L2 what it will read (`prefetch_rows_l2`: weights, KDA's state,
   MLA's cache rows), which returns nothing to the program: L2 is where the GPU's writes meet, so a line
   prefetched before the kernel before it writes that line is updated by the write, never stale. Nothing is
   stored; a value loaded there only ever addresses a prefetch (a routed expert's id, KDA's slot: a stale one costs
   a useless prefetch, never a wrong result), and the kernel loads it again after the wait (tests/test_pdl.py
   checks each kernel's PTX for this order);
2. `griddepcontrol.wait`: the kernel before it has completed and its writes are visible;
3. `griddepcontrol.launch_dependents`: the next kernel may start its own step 1.
A kernel lets the next one start only after its own wait, so when any kernel passes its wait, every kernel before
it in the stream has completed. Kernels launched without PDL (cuBLAS, torch's own) wait for the one before them as
always; a PDL kernel after one of them starts when it exits. A CUDA graph captured from such launches keeps the
programmatic edges. Prefetches may come after the wait too (loops keeping a few tiles ahead of their loads), and
without PDL where a module's LAUNCH opts in (`prefetching`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3 import envs

# Bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, sm_90) take 16-byte-aligned addresses and sizes.
ALIGN = 16


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def prefetching(launch: dict, t: torch.Tensor, *tensors: torch.Tensor, opted_in: bool = False) -> bool:
    """Whether a kernel on t's device prefetches `tensors` into L2: under PDL (`launch`) unless K3_NO_PDL_PREFETCH,
    or where its module's LAUNCH opts in (`opted_in`: a kernel whose own prologue the prefetch overlaps); CUDA
    sm_90+ only, rows aligned for the bulk prefetch."""
    return (((launch["PDL"] and not envs.current().no_pdl_prefetch)
             or (opted_in and t.is_cuda and _hopper_or_later(t.device.index)))
            and prefetchable(*tensors))


def launch(t: torch.Tensor) -> dict:
    """A PDL kernel's launch keywords for work on t's device: `PDL` (the kernel's constexpr: `pdl_enter` waits,
    and prefetches where the kernel has any) and, where it is on, Triton's `launch_pdl`. On where K3_PDL is set and
    t is on a CUDA device of compute capability 9.0 or later; off elsewhere (the interpreter, older cards)."""
    on = t.is_cuda and envs.current().pdl and _hopper_or_later(t.device.index)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


def prefetchable(*tensors: torch.Tensor) -> bool:
    """Whether rows of these tensors can be bulk-prefetched: each 16-byte aligned, every stride but the last a
    multiple of 16 bytes (a row's slice then starts aligned where its column offset is a multiple of 16 bytes)."""
    return all(t.data_ptr() % ALIGN == 0 and all(s * t.element_size() % ALIGN == 0 for s in t.stride()[:-1])
               for t in tensors)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Steps 2 and 3 above (nothing without PDL). Everything before it may only prefetch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """One bulk prefetch into L2 per element: nbytes[i] (a multiple of 16; 0: none) from ptrs[i] (16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_range_l2(ptr, count, CHUNKS: tl.constexpr):
    """Prefetches `count` elements of ptr's type from ptr (16-byte aligned; the bytes rounded down to 16; none
    where count ≤ 0), cut into CHUNKS pieces."""
    prefetch_rows_l2(ptr + tl.zeros([1], dtype=tl.int32), tl.full([1], True, tl.int1), count, CHUNKS)


@triton.jit
def prefetch_rows_l2(row_ptrs, row_ok, row_count, CHUNKS: tl.constexpr):
    """Prefetches `row_count` elements of the pointers' type from each row pointer (16-byte aligned; the bytes
    rounded down to 16; none where row_count ≤ 0) where row_ok, each row cut into CHUNKS pieces, so that a
    program's threads issue one each (rows × CHUNKS = its threads)."""
    elem: tl.constexpr = row_ptrs.dtype.element_ty.primitive_bitwidth // 8
    row_bytes = tl.maximum(row_count, 0) * elem
    chunk = tl.cdiv(tl.cdiv(row_bytes, CHUNKS), 16) * 16
    starts = tl.arange(0, CHUNKS) * chunk
    size = tl.minimum(tl.maximum(row_bytes - starts, 0), chunk) // 16 * 16  # [CHUNKS]
    ptrs = row_ptrs.to(tl.pointer_type(tl.int8))[:, None] + starts[None, :]
    _prefetch_l2(ptrs, tl.where(row_ok[:, None], size[None, :], 0).to(tl.int32))
