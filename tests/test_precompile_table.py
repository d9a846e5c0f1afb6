"""The shipped autotune table's precompile list against today's kernels: every k3 kernel of the recorded training
step is compiled for the spec's GPU (sm_90) by Triton's own compiler, which needs no GPU. A spec recorded before
a kernel's parameters changed fails in the precompile workers of every GPU run (costing the compile time they
exist to save); here it fails on the CPU. fla's kernels are left to the table's fla version check."""
import json

import pytest

pytest.importorskip("triton")

from k3.ops import precompile, tuning  # noqa: E402


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
    import torch

    from k3.ops import _attn_res_triton

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    preloaded = []
    monkeypatch.setattr(_attn_res_triton._mix_bwd_kernel, "preload", preloaded.append)
    path = tmp_path / "share.json"
    path.write_text(json.dumps([stale_mix_bwd_spec()]))
    assert precompile.main(["0", str(path)]) == 0
    assert preloaded == []
    err = capsys.readouterr().err
    assert "1 of 1 kernels not compiled ahead" in err and "_mix_bwd_kernel: stale" in err
