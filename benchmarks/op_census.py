"""The one rule k3's op censuses count by (decode_op_census, prefill_pieces_census, profile_serve --census): whether
a torch op, as a TorchDispatchMode sees it, launches a kernel on a GPU."""
from __future__ import annotations

import torch

# allocations, metadata and host reads: no kernel
NO_KERNEL = frozenset({"_unsafe_view", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                       "lift_fresh", "detach", "detach_", "alias", "_reshape_alias", "set_", "sym_size", "sym_stride",
                       "sym_numel", "is_same_size"})
HOST_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero"})


def launches_kernel(func, args, out) -> bool:
    """Whether `func(*args)`, which returned `out`, launched a kernel. Ops outside aten/prim (k3's and other
    custom ops) do. A view op by its schema does only where it made new memory: `to` and `contiguous`-like ops
    alias their input when nothing changes, and on torch 2.13 aten.to.dtype is a view op by schema while a real
    cast is a kernel."""
    if func.namespace not in ("aten", "prim"):
        return True
    short = func._schema.name.split("::")[-1]
    if short in NO_KERNEL or short in HOST_READS:
        return False
    return not func.is_view or made_new_memory(out, args)


def made_new_memory(out, args) -> bool:
    src = args[0] if args else None
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)
            and out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr())
