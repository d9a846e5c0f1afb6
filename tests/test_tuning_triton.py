"""k3.ops.tuning against Triton's own Autotuner: a pinned key runs the pinned config without benchmarking, another
key autotunes as before, and `record` reads Triton's cache back in the table's form. On CUDA where there is one,
else on the CPU under the Triton interpreter. Skipped where triton is not installed (tests/test_tuning.py covers
the table with Autotuner-shaped fakes there)."""
import importlib
import json
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from k3.ops import tuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODULE = "k3.ops._fake_triton_tuned"


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
                 key=["n"])
@triton.jit
def fill_with_block(out_ptr, n, BLOCK: tl.constexpr):
    """Writes BLOCK into the first min(n, BLOCK) elements: the output shows which config ran."""
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.full([BLOCK], BLOCK, tl.int32), mask=offsets < n)


@pytest.fixture
def kernel(monkeypatch):
    module = types.ModuleType(MODULE)
    module.fill_with_block = fill_with_block
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(fill_with_block.base_fn, "__module__", MODULE)
    monkeypatch.setattr(fill_with_block, "cache", {})
    benched = []

    def fake_bench(*args, config, **meta):  # BLOCK 16 "wins" whenever Triton benchmarks
        benched.append(config.kwargs["BLOCK"])
        return [float(config.kwargs["BLOCK"])] * 3
    monkeypatch.setattr(fill_with_block, "_bench", fake_bench)
    return benched


def run(n):
    out = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    fill_with_block[(1,)](out, n)
    return out.cpu()


def test_a_pinned_key_runs_its_config_unbenchmarked_and_other_keys_autotune(kernel):
    section = {f"{MODULE}.fill_with_block": [{"key": [64, "torch.int32"], "config": {
        "kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}]}
    table = {"format": tuning.FORMAT, "gpus": {"GPU": {"kernels": section}}}
    assert tuning.pin(tuning.parse_table(table)["GPU"]["kernels"]) == 1
    out = run(64)
    assert kernel == []  # the pinned key: no benchmark
    assert out[:32].tolist() == [32] * 32 and out[32:].tolist() == [0] * 32
    out = run(48)  # another key: Triton tunes it (the fake timings pick BLOCK 16)
    assert sorted(kernel) == [16, 32]
    assert out[:16].tolist() == [16] * 16 and out[16:].tolist() == [0] * 48


def test_record_reads_tritons_cache_in_the_tables_form(kernel):
    run(40)
    recorded = tuning.record()
    assert recorded[f"{MODULE}.fill_with_block"] == [{"key": [40, "torch.int32"], "config": {
        "kwargs": {"BLOCK": 16}, "num_warps": 1, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}]


def test_record_compiles_keeps_each_kernels_specialisation_once_in_first_use_order(kernel):
    from triton import knobs

    def spec(name, warps):
        return {"name": name, "signature": {"out_ptr": "*i32"}, "constant_keys": [[2]], "constant_vals": [32],
                "attrs_keys": [], "attrs_vals": [], "key": "k",
                "options": {"num_warps": warps, "extern_libs": [["libdevice", "/site/libdevice.10.bc"]]}}
    compiled = [spec(f"{MODULE}.b", 4), spec(f"{MODULE}.a", 2), spec(f"{MODULE}.b", 4),
                spec("tests.test_x.kernel", 1), spec(f"{MODULE}.outer.<locals>.inner", 1)]
    jit_like = types.SimpleNamespace(preload=None, device_caches={"sentinel": "compiled before"})
    sys.modules[MODULE].jit_like = jit_like  # a JITFunction's two fields that matter here (the interpreter has none)
    before = knobs.runtime.jit_post_compile_hook

    def step():  # what Triton's JITFunction does after each compile (or disk-cache load)
        for s in compiled:
            knobs.runtime.jit_post_compile_hook(key="k", repr="r", fn=None, compile={
                "specialization_data": json.dumps(s)}, is_manual_warmup=False, already_compiled=False)
    recorded = tuning.record_compiles(step)
    assert [(s["name"], s["options"]) for s in recorded] == [(f"{MODULE}.b", {"num_warps": 4}),
                                                             (f"{MODULE}.a", {"num_warps": 2})]
    assert jit_like.device_caches == {}  # dropped, so the step loads each kernel again
    assert knobs.runtime.jit_post_compile_hook is before


def test_every_kernel_of_the_shipped_table_is_an_autotuned_kernel_of_this_fla_taking_its_fields():
    pytest.importorskip("fla")
    sections = {gpu: s for gpu, s in tuning.load_table(tuning.TABLE_PATH).items() if s["fla"] == tuning.fla_version()}
    if not sections:
        pytest.skip(f"the shipped table has no section for fla {tuning.fla_version()}")
    for gpu, section in sections.items():
        assert section["kernels"], gpu
        for name, entries in section["kernels"].items():
            tuner = tuning.resolve_kernel(name)
            for key, config in entries:
                assert set(config["kwargs"]) <= set(tuner.arg_names), (gpu, name)
                assert len(key) >= len(tuner.keys), (gpu, name)  # the key arguments, then the tensors' dtypes
        for spec in section["compiles"]:  # under the interpreter a kernel is no JITFunction: its name must exist
            module, _, attr = spec["name"].rpartition(".")
            assert hasattr(importlib.import_module(module), attr), (gpu, spec["name"])
