"""Compile a k3 Triton kernel for sm_90 (the H200) on any machine, no GPU: Triton's own ptxas, as a launch on the
card would. Catches what the interpreter cannot (code generation, register allocation) and exposes the PTX, so
tests can check the memory-ordering instructions a kernel relies on. Runs in a fresh process without
TRITON_INTERPRET (in a process that set it, triton.language is the interpreter's)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, num_warps, stage, divisible, unaligned = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
signature = {k: tuple(v) if isinstance(v, list) else v for k, v in signature.items()}
from sass_mxfp4_loop import launch_attrs  # the arguments specialised as a launch specialises them
src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                attrs=launch_attrs(signature, divisible, unaligned))
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
if stage == "resources":  # ptxas's allocation, read from the cubin as the SASS benchmarks read it
    from sass_mxfp4_loop import resources
    sys.stdout.write(json.dumps(resources(kernel)))
else:
    sys.stdout.write(kernel.asm[stage])
"""


def ptx_for_sm90(module: str, kernel: str, signature: dict, num_warps: int = 4, **constexprs) -> str:
    """The PTX of `module.kernel` (a @triton.jit function) compiled through ptxas for sm_90, for the argument
    types in `signature` ("*bf16", "i32", a tuple of them, ...) and the constexprs, specialised as Triton
    specialises a launch: every pointer 16-byte aligned but those named in `unaligned` (a column slice off a
    16-byte boundary), and the integers named in `divisible` multiples of 16."""
    return asm_for_sm90("ptx", module, kernel, signature, num_warps, **constexprs)


def registers_for_sm90(module: str, kernel: str, signature: dict, num_warps: int = 4, **constexprs) -> dict:
    """{"REG": registers a thread, "STACK": bytes a thread spilled to local memory, "SHARED": bytes} as ptxas
    allocated them for sm_90 (benchmarks/sass_mxfp4_loop.resources). A spill is ptxas's choice, made after the
    PTX: `.local` in the PTX shows only what Triton itself put there, so "no spills" is read here."""
    return json.loads(asm_for_sm90("resources", module, kernel, signature, num_warps, **constexprs))


def asm_for_sm90(stage: str, module: str, kernel: str, signature: dict, num_warps: int = 4,
                 divisible: tuple[str, ...] = (), unaligned: tuple[str, ...] = (), **constexprs) -> str:
    """One stage of that compilation ("ttir": Triton's IR after its own passes, "ttgir", "ptx", ...; "resources":
    `registers_for_sm90`'s JSON)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    benchmarks = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, benchmarks, env.get("PYTHONPATH")) if p)
    args = json.dumps([module, kernel, signature, constexprs, num_warps, stage, list(divisible), list(unaligned)])
    # a cache of its own: a shared one may hold the kernel packed without its PTX (run_h200.sh's `pack`)
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", _SCRIPT, args], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
