"""When k3's own Triton kernels run: CUDA tensors, triton importable, not switched off by K3_NO_TRITON
(=1 for all, or a comma-separated list of kernel modules). Kernels in OPT_IN pass their tests but have no speed
measured on a GPU yet: they run only when named in K3_TRITON (a comma-separated list, or "all"). Both are
parsed once, in k3.envs (tests switch them with `k3.envs.override`). `use_triton` leaves compiled regions to
inductor; `use_triton_op` also chooses, inside torch.compile, the inference kernels entered through a
torch.library custom op (decode's router and AttnRes mix + norm), which a compiled graph keeps as one call.

Kernel modules (`k3.ops._*_triton`) import triton at the top, so they are imported only through
`triton_module`, which returns None where triton is missing (the CPU install). Tests may call a kernel module's
functions on CPU tensors under TRITON_INTERPRET=1, where triton is installed.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType

import torch

from k3 import envs


# _router_triton, _attn_res_norm_triton, _kda_decode_triton: decode's router, mix + norm and KDA step, tested under
# the interpreter only so far
OPT_IN = frozenset({"_mla_decode_triton", "_router_triton", "_attn_res_norm_triton", "_sigmoid_gate_triton",
                    "_kda_decode_triton", "_mla_static_decode_triton"})


_modules: dict[str, ModuleType | None] = {}


def triton_module(name: str) -> ModuleType | None:
    """`k3.ops.<name>`, or None when it cannot be imported (no triton). Cached in a plain dict, which a
    torch.compile region reads as a constant (an import cannot be traced: a first call there breaks its graph)."""
    if name not in _modules:
        _modules[name] = _import_kernels(name)
    return _modules[name]


@torch.compiler.disable
def _import_kernels(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"k3.ops.{name}")
    except ImportError:
        return None


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
    switches = envs.current()
    if switches.triton_off(name) or (name in OPT_IN and not switches.triton_opted_in(name)):
        return False
    return triton_module(name) is not None
