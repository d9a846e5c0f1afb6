"""The commands around k3.ops.tuning: `k3 tune` and `k3 train`'s early start of the kernels (CPU)."""
from k3.ops import tuning


def test_k3_tune_without_a_gpu_is_one_error_line(capsys, monkeypatch):
    import torch

    from k3.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 tune: error: needs a CUDA GPU") and err.count("\n") == 1


def test_k3_train_on_one_gpu_starts_the_kernels_before_loading_and_ranks_leave_it(monkeypatch):
    import torch

    from k3 import cli

    asked = []
    monkeypatch.setattr(tuning, "pin_for_device", lambda device: asked.append(str(device)))
    cli._start_kernels_early("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cli._start_kernels_early("auto")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cli._start_kernels_early("cuda")
    assert asked == ["cuda"]
