"""k3's Triton launchers without a gradient to track (inference) launch straight, past autograd.Function's host
work: the same kernel, the same result bit for bit, and no graph node. On CUDA where there is one, else on CPU
under the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from k3.ops import _norm_triton  # noqa: E402
from k3.ops.fused_situ import _FusedSiTUGLU, fused_situ_glu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def calls(monkeypatch, cls):
    """Counts cls.apply calls (the autograd.Function path)."""
    seen = []
    original = cls.apply
    monkeypatch.setattr(cls, "apply", lambda *a: seen.append(1) or original(*a))
    return seen


@pytest.mark.parametrize("name", ["rms_norm", "l2_norm", "situ"])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_inference_launch_equals_the_autograd_path(monkeypatch, name, mode):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 7, 64, generator=g) * 2).bfloat16().to(DEVICE)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(DEVICE)
    wide = torch.randn(3, 7, 128, generator=g).bfloat16().to(DEVICE)
    fns = dict(rms_norm=(lambda a: _norm_triton.rms_norm(a, w, 1e-5), _norm_triton._TritonNorm),
               l2_norm=(lambda a: _norm_triton.l2_norm(a), _norm_triton._TritonNorm),
               situ=(lambda a: fused_situ_glu(a, wide[..., 64:]), _FusedSiTUGLU))  # up: a strided view
    fn, cls = fns[name]
    applied = calls(monkeypatch, cls)
    with_grad = fn(x.detach().requires_grad_())
    assert len(applied) == 1 and with_grad.grad_fn is not None
    with getattr(torch, mode)():
        straight = fn(x.detach().requires_grad_())
    assert len(applied) == 1 and straight.grad_fn is None  # no Function this time
    assert straight.dtype == with_grad.dtype and torch.equal(straight, with_grad.detach())
