"""Decode's routed experts slot by slot (k3.ops._moe_decode_triton: one gate+up program a slot and block of rows,
one down program a token summing its k choices) against `selected_experts_situ_mlp_reference` in float64: one and
two tokens (the batch sizes that take it), top-k 1..8, widths that are no multiple of the tiles and narrower than
one, a token that picks one expert twice, bf16 weights. On CUDA where there is one, else on the CPU under the
Triton interpreter; skipped where triton is not installed. (Slots held by another rank: test_expert_skip_triton.)"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from k3.ops import _moe_decode_triton as kernels  # noqa: E402
from k3.ops.moe_decode import selected_experts_situ_mlp_reference  # noqa: E402
from test_moe_expert_major_triton import DEVICE, case, rel_err  # noqa: E402


@pytest.mark.parametrize("N,k,E,L,I", [
    (1, 8, 64, 96, 64),  # small's top-8 of 64 (narrower rows)
    (2, 3, 8, 300, 40),  # L past one 256-wide step and no multiple of it
    (1, 1, 4, 24, 700),  # top-1; I past one 512-wide block of the down kernel
    (2, 5, 16, 50, 3),  # I narrower than one row block
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_slot_major_kernel_equals_the_reference(N, k, E, L, I, dtype, tol):
    z, idx, wt, w1, w3, w2 = (t.to(dtype) if t.is_floating_point() else t for t in case(N, k, E, L, I, seed=N + 7 * k))
    out = kernels.selected_experts_situ_mlp(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0)
    want = selected_experts_situ_mlp_reference(*(t.double() if t.is_floating_point() else t
                                                 for t in (z, idx, wt, w1, w3, w2)))
    assert out.shape == (N, L) and out.dtype == dtype
    assert rel_err(out, want) < tol


def test_a_token_may_pick_one_expert_twice():
    """Both slots count (the down program sums its k choices, not its distinct experts)."""
    z, idx, wt, w1, w3, w2 = case(2, 3, 6, 40, 24, seed=3, idx=torch.tensor([[2, 2, 5], [0, 1, 0]]))
    out = kernels.selected_experts_situ_mlp(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0)
    want = selected_experts_situ_mlp_reference(*(t.double() if t.is_floating_point() else t
                                                 for t in (z, idx, wt, w1, w3, w2)))
    once = selected_experts_situ_mlp_reference(z.double(), idx[:, 1:], wt[:, 1:].double(), w1.double(), w3.double(),
                                               w2.double())
    assert rel_err(out, want) < 1e-5 and rel_err(out, once) > 1e-2
