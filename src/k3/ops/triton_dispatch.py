"""When k3's own Triton kernels run: CUDA tensors, triton importable, not switched off by K3_NO_TRITON
(=1 for all, or a comma-separated list of kernel modules). Kernels in OPT_IN pass their tests but have no speed
measured on a GPU yet: they run only when named in K3_TRITON (a comma-separated list, or "all"). Both are
parsed once, in k3.envs (tests switch them with `k3.envs.override`). `use_triton` leaves compiled regions to
inductor; `use_triton_op` also chooses, inside torch.compile, the inference kernels entered through a
torch.library custom op (decode's router and AttnRes mix + norm), which a compiled graph keeps as one call.

Those custom ops are declared with `inference_op` and entered through `call_op`: the op inside torch.compile (the
graph keeps it as one opaque call, its fake impl gives the shapes), the op's own Python function elsewhere. Eager
code gains nothing from the dispatcher's round trip, which cost 28-45 µs a call on the H200's host (issue 21:
AttnRes mix + norm, 32 calls a prefill step) against the 22-35 µs of the launch itself; the function is the same
launch, so CUDA graph capture (eager) records the same kernel.

Kernel modules (`k3.ops._*_triton`) import triton at the top, so they are imported only through
`triton_module`, which returns None where triton is missing (the CPU install). Tests may call a kernel module's
functions on CPU tensors under TRITON_INTERPRET=1, where triton is installed.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType
from typing import Callable

import torch

from k3 import envs
from k3 import ops as ops_package  # (this module's package: its kernel modules are its attributes)
from k3.ops.lazy_dynamo import assume_constant_result


# Kernels that pass their tests but are not yet shown faster on a GPU run only where K3_TRITON names them.
# _gemv_triton (decode's linears): CUDA tests pass, but on an H200 (session 13) it beat cuBLAS only on the narrow
# linears and lost on the wide ones (lm_head, the dense MLP) and at 8 rows: a graphed small decode step 2.04 -> 2.01
# ms at batch 1, 3.44 -> 3.78 at batch 8. Decode's router, mix + norm and KDA step left this list in session 12, MLA's
# StaticCache decode and the expert-major routed experts in session 13 (H200: CUDA tests passed; graphed small decode
# 3.44 -> 2.60 ms at batch 8 and 5.63 -> 4.28 at batch 64 with both; benchmarks/RESULTS.md). The MoE's slot sums
# left it in session 16 (H200: 395 against 1,708 µs for the combine forward + backward; the small step at 8 x 4096
# 376 -> 353 ms).
# The serving step's varlen short convs (_conv_varlen_triton) left it in session 20 (H200: 54 against 931 µs a layer
# at 2,048 tokens, 0.65 against 11.2 ms a step; profile_serve's 64 streams ~10,900 -> ~12,000 output tok/s).
# The serving pool's KDA state rows under the static layout (_slot_rows_triton: only the step's real rows move, not
# the scratch slot's empty documents) left it in session 24 (H200: CUDA tests passed; the gathers and index_puts'
# ~1.3 ms a mixed step became one ~0.2 ms kernel; serve64 12,446 -> 12,822 and 11,083 -> 12,485 tok/s in two A/Bs).
# Decode's GEMV (_gemv_triton, taken only where `gemv.kernel_wins`: ≤ 4 rows, ≤ 16 with a prologue) left it in
# session 26 (H200: the graphed batch-1 step of `small` 1.40 -> 1.27 ms at 4K context, bench_gpu_decode.py, same
# call).
# _attn_res_route_triton (a MoE layer's second mix and its router in one launch, session 31) left it in session 32
# (H100: CUDA tests passed; the graphed batch-1 step of `small` 1.23 -> 1.13 ms at 4K context, batch 8 2.09 -> 2.07,
# batch 64 3.47 -> 3.49, bench_gpu_decode.py --opt-in, same call).
# MLA's output gate (_sigmoid_gate_triton) and keys (_mla_keys_triton) left it in session 41 (H100: CUDA tests
# passed; the `small` step at 8 x 4096, documents of 512, 348, 350 -> 345, 347 ms with both, bench_gpu_train.py,
# same call; each 0.11 against ~0.30 ms forward at 8 x 4096, bench_gpu_kernels.py --only MLA).
OPT_IN = frozenset({"_mla_decode_triton"})


_modules: dict[str, ModuleType | None] = {}


def triton_module(name: str) -> ModuleType | None:
    """`k3.ops.<name>`, or None when it cannot be imported (no triton); imported once. Inside torch.compile too: the
    import runs as the region is traced (`_importable`; an import cannot be traced), and the module is then read as
    an attribute of k3.ops, which Dynamo sees as the module itself (its kernels callable) with no guard on the
    import cache (a first import changes it: the region would compile again)."""
    return getattr(ops_package, name) if _importable(name) else None


@assume_constant_result  # Dynamo runs it as it traces, its answer a constant: no graph break
def _importable(name: str) -> bool:
    if name not in _modules:
        _modules[name] = _import_kernels(name)
    return _modules[name] is not None


def _import_kernels(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"k3.ops.{name}")
    except ImportError:
        return None


class Forced:
    """A kernel selector's override for tests: `with force(True):` takes the kernel wherever the inputs fit it
    (on CPU tensors too, under the Triton interpreter), `force(False)` never, `force(None)` as the selector
    decides; `.value` is the setting of the innermost block."""

    def __init__(self):
        self.value: bool | None = None

    @contextlib.contextmanager
    def __call__(self, flag: bool | None):
        saved, self.value = self.value, flag
        try:
            yield
        finally:
            self.value = saved


def on_device(t: torch.Tensor | torch.device):
    """A context on the CUDA device of t (a tensor or a device); nothing on the CPU. Triton kernels, new streams,
    events and graphs follow the current device, which need not be t's (a model on cuda:1, or the engine's own
    thread, where the current device is 0)."""
    device = t if isinstance(t, torch.device) else t.device
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device: how many programs fill it (grid sizing of the kernels)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_tiles(rows: int, cols: int, elements: int) -> tuple[tuple[int, int], int, int]:
    """(grid, rows a tile, columns a tile) of an elementwise kernel over a [rows, cols] tensor whose programs each
    take a tile of about `elements`: a row's columns in blocks of up to 1024 (a power of two), as many rows as fill
    the rest, so that a program finds each element's row and column without an integer division."""
    block_c = min(1024, 1 << max(cols - 1, 0).bit_length())  # (triton.next_power_of_2: this module needs no triton)
    block_r = max(1, elements // block_c)
    return (-(-rows // block_r), -(-cols // block_c)), block_r, block_c


# Ticket workspaces (the kernels whose last program merges the others' partials draw atomic tickets), per device,
# every one ever handed out: a captured CUDA graph keeps writing the one it was captured with, so none may be freed
# and its memory reused. A kernel leaves its workspace zero, and the launches of one stream never overlap, so every
# layer and kernel shares one.
_ticket_workspaces: list[torch.Tensor] = []


def ticket_workspace(entries: int, device: torch.device) -> torch.Tensor:
    """An int32 zero workspace of at least `entries` entries on `device`."""
    for t in reversed(_ticket_workspaces):
        if t.device == device and t.numel() >= entries:
            return t
    fresh = torch.zeros(max(entries, 64), dtype=torch.int32, device=device)
    if not torch.compiler.is_compiling():  # a traced step zeroes its own: growing the list it guards on would
        _ticket_workspaces.append(fresh)   # recompile it at its next call
    return fresh


_op_functions: dict[str, Callable] = {}


def inference_op(name: str, mutates_args: tuple[str, ...] = ()):
    """`torch.library.custom_op("k3::<name>", mutates_args=...)` for an inference kernel's launch (no autograd
    formula), its Python function also kept for `call_op`. Returns the op (`.register_fake` as usual)."""
    def register(fn: Callable):
        _op_functions[name] = fn
        return torch.library.custom_op(f"k3::{name}", mutates_args=mutates_args)(fn)
    return register


def call_op(name: str, *args, **kwargs):
    """The `inference_op` k3::<name> on these arguments: through the dispatcher (`torch.ops.k3.<name>`) inside
    torch.compile, where the graph keeps it as one call (inductor given its lowering first, `_lowered_as_a_call`);
    otherwise its function called directly (the same launch, in-place writes included, without the dispatcher's
    host cost). The dispatcher is kept, too, where it does
    something: a torch dispatch mode is active (FakeTensorMode tracing, a FlopCounterMode), or an input needs a
    gradient (the op then answers as it would: it has no autograd formula, so backward raises, where the bare launch
    would hand back an output silently cut from the graph)."""
    compiling = torch.compiler.is_compiling()
    if compiling:
        _lowered_as_a_call(name)
    if (compiling or torch._C._len_torch_dispatch_stack()
            or (torch.is_grad_enabled() and _any_requires_grad(args, kwargs.values()))):
        return getattr(torch.ops.k3, name)(*args, **kwargs)
    return _op_functions[name](*args, **kwargs)


@assume_constant_result  # Dynamo runs it as it traces (an import cannot be traced); no graph node, no break
def _lowered_as_a_call(name: str) -> bool:
    """Give inductor the lowering of k3::<name> that it would make itself, before it lowers the graph: a call of
    the op as it is, under the layout constraint of the op's tags. Made by inductor, on torch 2.11 that fallback
    first formats every input's IR tree into a log line, eagerly (2.13 formats it lazily): in a compiled decode
    step, whose inputs' trees run through the layers, minutes an op (session 32's H100 run of
    test_attn_res_norm_triton's compiled graph stopped there)."""
    lowering = importlib.import_module("torch._inductor.lowering")
    op = getattr(torch.ops.k3, name).default
    if op not in lowering.lowerings and hasattr(lowering, "tag_to_layout_constraint"):
        tag = lowering.get_layout_constraint_tag(op, with_default=True)
        lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag), warn=False)
    return True


def _any_requires_grad(*groups) -> bool:
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                if a.requires_grad:
                    return True
            elif isinstance(a, (list, tuple)) and _any_requires_grad(a):
                return True
    return False


def use_triton(x: torch.Tensor, name: str) -> bool:
    """Whether x should take the kernels of `k3.ops.<name>`: CUDA, a float dtype, triton there, not disabled,
    and not inside torch.compile (inductor fuses the plain-PyTorch path itself)."""
    return not torch.compiler.is_compiling() and use_triton_op(x, name)


def use_triton_op(x: torch.Tensor, name: str) -> bool:
    """`use_triton` inside torch.compile too, for inference kernels entered through a torch.library custom op
    (decode's router and AttnRes mix + norm): a compiled region keeps such an op as one opaque call, where
    inductor would not fuse what the kernel does."""
    if not isinstance(x, torch.Tensor):
        return False
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    return switched_on(name) and triton_module(name) is not None


def switched_on(name: str) -> bool:
    """Whether the K3_* switches let `k3.ops.<name>` run: not turned off (K3_NO_TRITON), and named in K3_TRITON
    where it is in OPT_IN."""
    switches = envs.current()
    return not switches.triton_off(name) and (name not in OPT_IN or switches.triton_opted_in(name))
