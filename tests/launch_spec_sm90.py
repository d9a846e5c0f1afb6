"""The precompile specs (JITFunction.preload's specialisation data, as `k3 tune` records them into the autotune
table's "compiles") that k3's launches would make on an H200, made on any machine without a GPU: the launches run
on meta tensors with each Triton kernel's launch replaced by a capture, and Triton's own binder specialises the
captured arguments for sm_90 (a meta tensor's address is 0: 16-byte aligned, as a CUDA allocation). Runs in a fresh
process without TRITON_INTERPRET (under it, kernels are the interpreter's)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

_SCRIPT = r"""
import json, sys
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import jit

launches = []  # (kernel, positional arguments, keyword arguments) of each launch, in order
saved_getitem = jit.JITFunction.__getitem__
jit.JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: launches.append((self, args, kwargs)))
try:
    exec(sys.argv[1], {})
finally:
    jit.JITFunction.__getitem__ = saved_getitem

backend = make_backend(GPUTarget("cuda", 90, 32))
specs = []
for fn, args, kwargs in launches:
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    key = str(specialization) + str(options)  # the in-process cache key a launch computes
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    spec = json.loads(jit.serialize_specialization_data(jit.get_full_name(fn), signature, constexprs, attrs,
                                                        options, key))
    spec["options"].pop("extern_libs", None)  # as k3.ops.tuning.record_compiles stores them
    specs.append(spec)
sys.stdout.write(json.dumps(specs))
"""


def launch_specs(code: str) -> list[dict]:
    """The specs of every Triton launch `code` (Python source, run in a fresh process) makes, in launch order."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", _SCRIPT, code], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
