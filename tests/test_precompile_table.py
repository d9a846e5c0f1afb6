"""The shipped autotune table's precompile list against today's kernels: every k3 kernel of the recorded training
step is compiled for the spec's GPU (sm_90) by Triton's own compiler, which needs no GPU. A spec recorded before
a kernel's parameters changed fails in the precompile workers of every GPU run (costing the compile time they
exist to save); here it fails on the CPU. fla's kernels are left to the table's fla version check."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from k3.ops import precompile, tuning  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled_kernels():
    """These tests compile k3's kernels; where another module of the run set TRITON_INTERPRET=1 before they were
    imported (tests/test_tuning_triton.py does on a machine without CUDA), Triton interprets them instead."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("k3's kernels were decorated under Triton's interpreter (TRITON_INTERPRET=1): nothing compiles")


def k3_compiles():
    table = tuning.load_table(tuning.TABLE_PATH)
    return [(gpu, spec) for gpu, section in table.items() for spec in section["compiles"]
            if spec["name"].startswith("k3.")]


def test_the_table_lists_k3s_kernels_of_a_training_step():
    names = {spec["name"] for _, spec in k3_compiles()}
    # forward and backward of the AttnRes mix, the norm, the SiTU GLU (what a step of the small preset runs)
    for kernel in ("_attn_res_triton._mix_fwd_kernel", "_attn_res_triton._mix_bwd_kernel",
                   "_norm_triton._norm_fwd_kernel", "_norm_triton._norm_bwd_kernel", "_situ_triton.situ_glu_bwd_kernel"):
        assert f"k3.ops.{kernel}" in names


def test_every_k3_kernel_the_table_precompiles_compiles_for_its_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compile each, not an earlier run's cache hit
    failed = []
    for gpu, spec in k3_compiles():
        try:
            kernel = precompile.compile_spec(spec)
            assert kernel.asm.get("cubin"), spec["name"]  # compiled down to the GPU's binary
        except Exception as e:
            failed.append(f"{gpu}: {spec['name']} {spec['constant_vals']}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}")
    assert not failed, "\n".join(failed)


def stale_mix_bwd_spec():
    """A _mix_bwd_kernel spec as recorded before the kernel took `addends` and `accumulate` (session 11)."""
    spec = json.loads(json.dumps(next(s for _, s in k3_compiles() if s["name"].endswith("_mix_bwd_kernel"))))
    spec["signature"] = {k: v for k, v in spec["signature"].items() if k not in ("addends", "accumulate")}
    return spec


def test_a_spec_recorded_before_the_kernels_parameters_changed_is_named_stale():
    with pytest.raises(ValueError, match=r"_mix_bwd_kernel: stale: .*\['addends', 'accumulate'\]"):
        precompile.compile_spec(stale_mix_bwd_spec())


def test_the_worker_reports_a_stale_spec_without_compiling_it(tmp_path, monkeypatch, capsys):
    import triton

    compiled = []
    monkeypatch.setattr(triton, "compile", lambda *a, **k: compiled.append(a))
    path = tmp_path / "share.json"
    path.write_text(json.dumps([stale_mix_bwd_spec()]))
    assert precompile.main([str(path)]) == 0
    assert compiled == []
    err = capsys.readouterr().err
    assert "1 of 1 kernels not compiled ahead" in err and "_mix_bwd_kernel: stale" in err


PRIMARY_CONTEXT = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
flags, active = ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
print("primary context active:", active.value)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_worker_compiles_what_the_kernels_first_call_reads_without_a_cuda_context(tmp_path):
    """The worker's compile lands under the key the kernel's own compile looks up (JITFunction.preload, the path
    of a first call: a cache read, no new file), and the worker never opened a CUDA context (each would hold
    ~0.5 GiB of the card while the run starts)."""
    table = tuning.load_table(tuning.TABLE_PATH)
    found = tuning.section_for(table, torch.cuda.get_device_name(), tuning.hardware_of(0))
    if found is None:
        pytest.skip("the shipped table has no section for this GPU's architecture")
    compiles = found[1]["compiles"]
    fla = [s for s in compiles if s["name"].startswith("fla.")][:1] if importlib.util.find_spec("fla") else []
    specs = [s for s in compiles if s["name"].startswith("k3.")][:2] + fla  # (importing fla must not open one either)
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    path = tmp_path / "share.json"
    path.write_text(json.dumps(specs))
    worker = subprocess.run([sys.executable, "-c", "import sys; from k3.ops import precompile; "
                             f"precompile.main([{str(path)!r}])\n" + PRIMARY_CONTEXT],
                            env=env, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stderr
    assert "primary context active: 0" in worker.stdout
    assert "not compiled ahead" not in worker.stderr
    def compiled():  # the kernels' files (not the Triton driver's helper library, built on first use of the GPU)
        return sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file() and p.suffix != ".so")
    written = compiled()
    assert written
    preload = subprocess.run([sys.executable, "-c", "import json; from k3.ops import tuning\n"
                              f"for s in json.loads({json.dumps(specs)!r}): "
                              "tuning.resolve_jit_function(s['name']).preload(json.dumps(s))"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert preload.returncode == 0, preload.stderr
    assert compiled() == written
