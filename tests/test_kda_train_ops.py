"""k3.ops.kda_train_ops: the KDA short conv and core as custom ops (what a compiled training region calls) compute
the plain references' values and gradients on random inputs (odd sizes, packed documents, float64), and pass
torch.library's own checks of their schemas, fake kernels and autograd registrations."""
import pytest
import torch

from k3.ops.conv import short_conv_reference
from k3.ops.kda_core import kda_core
from k3.ops.kda_train_ops import kda_core_train, kda_short_conv


def documents(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    """Packed rows: segment ids that change at random places (a change at every position possible)."""
    return (torch.rand(B, T, generator=g) < 0.3).long().cumsum(1)


def grads_of(fn, inputs: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(fn's output, the gradients of <output, a fixed random cotangent> for every input)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out.detach(), list(torch.autograd.grad((out * cot).sum(), leaves))


@pytest.mark.parametrize("B,T,C,W,packed,silu", [(2, 17, 12, 4, True, True), (1, 5, 7, 3, False, True),
                                                  (3, 9, 5, 4, True, False)])
def test_short_conv_op_equals_the_reference(B, T, C, W, packed, silu):
    g = torch.Generator().manual_seed(B * 100 + T)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, W, generator=g, dtype=torch.float64)
    doc_ids = documents(B, T, g) if packed else None
    got, got_grads = grads_of(lambda x, w: kda_short_conv(x, w, doc_ids, silu), [x, w], seed=T)
    want, want_grads = grads_of(lambda x, w: short_conv_reference(x, w, None, doc_ids, silu)[0], [x, w], seed=T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B,T,H,K,packed", [(2, 19, 2, 8, True), (1, 7, 3, 4, False), (2, 33, 1, 16, False)])
def test_core_op_equals_the_step_by_step_reference(B, T, H, K, packed):
    """The op (the chunked reference inside) against the recurrent reference, each document run alone."""
    g = torch.Generator().manual_seed(B * 1000 + T)
    q, k, v, f = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(4))
    beta_logits = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    A_log = torch.randn(H, generator=g, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(H * K, generator=g, dtype=torch.float64)
    doc_ids = documents(B, T, g) if packed else None
    inputs = [q, k, v, f, beta_logits, A_log, dt_bias]

    def by_steps(q, k, v, f, beta_logits, A_log, dt_bias):
        rows = []
        for b in range(B):
            ids = doc_ids[b] if packed else torch.zeros(T, dtype=torch.long)
            pieces = []
            for d in ids.unique_consecutive():
                at = (ids == d).nonzero().flatten()
                sl = slice(int(at[0]), int(at[-1]) + 1)
                o, _ = kda_core(*(t[b:b + 1, sl] for t in (q, k, v, f, beta_logits)), A_log, dt_bias, -5.0,
                                recurrent=True, backend="reference")
                pieces.append(o)
            rows.append(torch.cat(pieces, 1))
        return torch.cat(rows)

    got, got_grads = grads_of(lambda *t: kda_core_train(*t, -5.0, doc_ids), inputs, seed=T)
    want, want_grads = grads_of(by_steps, inputs, seed=T)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for name, a, b in zip(("q", "k", "v", "f", "beta_logits", "A_log", "dt_bias"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_ops_pass_torch_library_checks():
    """Schemas (nothing mutated or aliased), fake kernels (shapes, dtypes, strides as the real ones), the autograd
    registrations, and AOTAutograd's tracing of each with dynamic shapes."""
    g = torch.Generator().manual_seed(5)
    B, T, H, K = 2, 9, 2, 4
    doc_ids = documents(B, T, g)
    x = torch.randn(B, T, H * K, generator=g, requires_grad=True)
    w = torch.randn(H * K, 1, 4, generator=g, requires_grad=True)
    torch.library.opcheck(kda_short_conv, (x, w, doc_ids, True))
    q, k, v, f = (torch.randn(B, T, H, K, generator=g, requires_grad=True) for _ in range(4))
    beta_logits = torch.randn(B, T, H, generator=g, requires_grad=True)
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.randn(H * K, generator=g, requires_grad=True)
    torch.library.opcheck(kda_core_train, (q, k, v, f, beta_logits, A_log, dt_bias, -5.0, doc_ids))
    torch.library.opcheck(kda_core_train, (q, k, v, f, beta_logits, A_log, dt_bias, -5.0, None))
