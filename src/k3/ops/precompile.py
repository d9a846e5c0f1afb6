"""Compile Triton kernels ahead of their first call, in worker processes: Triton compiles lazily, one kernel at a
time, on the first call of each; a fresh machine's first step waits for each in turn. The workers compile the
autotune table's recorded specialisations (k3.ops.tuning) with Triton's compiler, as `JITFunction.preload` does, for
the architecture the table recorded, into the shared disk cache (TRITON_CACHE_DIR), while the main process builds the
model and runs; its own compile of a kernel a worker has finished is then a cache read. The workers never touch the
GPU (workers that set their device and called `preload` opened a CUDA context each: ~0.5 GiB of the card's memory
a worker while the run starts; 8 of them made a step at 2 x 16,384 run out of memory on an H100). A kernel
no worker reached yet is compiled by the main process as always, so precompiling can only save time; a failed
precompile is reported by the worker and costs nothing else.

Workers: K3_PRECOMPILE_WORKERS (default: half the cores, at most 8; 0: none). Worker:
`python -m k3.ops.precompile SPECS.json` (the file is removed once read).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

from k3 import envs

__all__ = ["worker_count", "start", "stale", "compile_spec", "main"]

_log = logging.getLogger(__name__)


def worker_count(n_specs: int) -> int:
    """K3_PRECOMPILE_WORKERS, else half the cores this process may use, shared by the ranks of this host, at most 8."""
    setting = envs.current().precompile_workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    auto = max(1, min(8, cores // 2 // ranks))
    return min(n_specs, auto if setting is None else setting)


def start(specs: list[dict]) -> list[subprocess.Popen]:
    """Start worker processes compiling `specs` (given in first-use order); returns them without waiting (they
    exit when done). The workers take the specs from the last needed back, round robin, while the main process
    meets its kernels from the first: the two meet in the middle instead of compiling the same kernels at once
    (a kernel the main process compiled first is a disk-cache read for the worker)."""
    n = worker_count(len(specs))
    workers = []
    last_first = specs[::-1]
    for share in (last_first[i::n] for i in range(n)):
        fd, path = tempfile.mkstemp(prefix="k3-precompile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(share, f)
        try:
            workers.append(subprocess.Popen([sys.executable, "-m", "k3.ops.precompile", path],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except OSError as e:  # no process to spare: the main process compiles as it always did
            os.unlink(path)
            _log.warning("k3 precompile: no worker process (%s): kernels compile at their first call", e)
            break
    return workers


def stale(spec: dict, fn) -> str | None:
    """Why `spec` no longer fits the JIT function `fn` (the kernel's parameters changed since the table was
    recorded: Triton would fail to compile it), or None."""
    params = [p.name for p in getattr(fn, "params", ())]
    recorded = list(spec["signature"])
    if params and recorded != params:
        missing = [p for p in params if p not in recorded] or [p for p in recorded if p not in params]
        return (f"stale: recorded with parameters {recorded}, the kernel has {params} (differ in {missing}); "
                "re-record it (`k3 tune` on that GPU, the kernel's old compiles removed first: merge keeps them)")
    return None


def compile_spec(spec: dict, target=None):
    """Compile one recorded specialisation with Triton's compiler into its disk cache, as `JITFunction.preload`
    does, for `target` (a triton GPUTarget; None: the spec's own arch, CUDA): no GPU is needed, so a machine
    without one can check that a table's compiles still fit the kernels. Returns the CompiledKernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3.ops.tuning import resolve_jit_function

    fn = resolve_jit_function(spec["name"])
    reason = stale(spec, fn)
    if reason:
        raise ValueError(f"{spec['name']}: {reason}")
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    if target is None:
        target = GPUTarget("cuda", int(options["arch"].removeprefix("sm")), options.get("warp_size", 32))

    def constant(value):  # as preload reads them: dtypes by name, wrapped constexprs
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        return tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value

    constexprs = {tuple(k): constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    # JSON made the tuple parameters' types lists; Triton wants tuples (as preload converts them)
    signature = {k: _as_tuple(v) for k, v in spec["signature"].items()}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def main(argv: list[str] | None = None) -> int:
    (path,) = argv if argv is not None else sys.argv[1:]
    with open(path) as f:
        specs = json.load(f)
    os.unlink(path)
    failed = []
    for spec in specs:
        try:
            compile_spec(spec)  # for the recorded arch: no CUDA context
        except Exception as e:  # a kernel this fla/Triton compiles differently: the main process compiles it
            failed.append(f"{spec.get('name')}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    if failed:
        print(f"k3 precompile: {len(failed)} of {len(specs)} kernels not compiled ahead: " + "; ".join(failed[:3]),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
