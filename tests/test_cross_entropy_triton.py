"""The Triton loss kernels (k3.ops._cross_entropy_triton) behind `chunked_cross_entropy`, against torch's
F.cross_entropy in float64: loss and gradient, fp32 and bf16 logits, ignored rows, rows longer than one block
and ragged, strided rows, large logits. On CUDA where there is one, else on CPU under the Triton interpreter;
skipped where triton is not installed."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

import k3.ops.cross_entropy as ce_mod  # noqa: E402
from k3.ops import _cross_entropy_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels_on(monkeypatch):
    """chunked_cross_entropy takes the kernels (on CPU too, under the interpreter)."""
    monkeypatch.setattr(ce_mod, "use_triton", lambda t, name: name == "_cross_entropy_triton")


def loss_and_grad(fn, logits, labels, scale):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, labels)
    (loss * scale).backward()
    return loss.detach(), x.grad


def truth(logits, labels, scale):
    return loss_and_grad(lambda x, y: F.cross_entropy(x, y, ignore_index=-100), logits.double(), labels, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed,N,V,block,ignored,spread", [
    (0, 7, 11, 4096, 0, 3.0),      # one short block per row
    (1, 9, 100, 16, 3, 3.0),       # 7 blocks per row, the last one ragged; ignored rows
    (2, 5, 64, 16, 0, 60.0),       # large logits: exp only after the running max is subtracted
    (3, 4, 33, 32, 1, 1.0),
])
def test_loss_and_gradient_match_torch(kernels_on, monkeypatch, seed, N, V, block, ignored, spread, dtype):
    monkeypatch.setattr(_cross_entropy_triton, "BLOCK_V", block)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g, dtype=torch.float64) * spread).to(dtype).to(DEVICE)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[:ignored]] = -100
    labels = labels.to(DEVICE)
    scale = 0.7
    got, got_grad = loss_and_grad(ce_mod.chunked_cross_entropy, logits, labels, scale)
    want, want_grad = truth(logits, labels, scale)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # 16-bit: the gradient rounded once
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=tol, atol=tol * float(want_grad.abs().max()))
    if ignored:
        assert torch.equal(got_grad[labels == -100], torch.zeros_like(got_grad[labels == -100]))


def test_strided_rows_and_all_rows_ignored(kernels_on, monkeypatch):
    """Rows read through their stride (a column slice of a wider buffer); with every row ignored the loss is
    nan and the gradient zero, as torch gives."""
    monkeypatch.setattr(_cross_entropy_triton, "BLOCK_V", 16)
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(6, 50, generator=g).to(DEVICE)
    logits, labels = wide[:, 3:40], torch.randint(0, 37, (6,), generator=g).to(DEVICE)
    assert logits.stride() == (50, 1)
    got, got_grad = loss_and_grad(ce_mod.chunked_cross_entropy, logits, labels, 1.0)
    want, want_grad = truth(logits, labels, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-6)
    none = torch.full((6,), -100, device=DEVICE)
    got, got_grad = loss_and_grad(ce_mod.chunked_cross_entropy, logits, none, 1.0)
    assert got.isnan() and torch.equal(got_grad, torch.zeros_like(got_grad))


def test_the_loss_takes_the_kernels_only_where_use_triton_says_so(monkeypatch):
    calls = []
    real = _cross_entropy_triton.log_sum_exp
    monkeypatch.setattr(_cross_entropy_triton, "log_sum_exp", lambda x: calls.append(1) or real(x))
    logits, labels = torch.randn(3, 8, device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE)
    if DEVICE == "cpu":
        ce_mod.chunked_cross_entropy(logits, labels)
        assert calls == []  # CPU tensors: the torch chunks
    monkeypatch.setattr(ce_mod, "use_triton", lambda t, name: name == "_cross_entropy_triton")
    ce_mod.chunked_cross_entropy(logits, labels)
    assert calls == [1]
