"""MLA's output gate `o ⊙ σ(gate)` in one Triton pass each way (k3.ops._sigmoid_gate_triton) against the torch
reference in float64: strided o (a slice of wider heads, as attention hands it on CUDA), shapes off the block
sizes, bf16; and the MLA layer through the kernel against its torch path. On CUDA the kernels run natively; on a
CPU with triton installed under the interpreter; without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3.ops import sigmoid_gate as gate_mod  # noqa: E402
from k3.ops.sigmoid_gate import _SigmoidGate, sigmoid_gate_reference  # noqa: E402

from mla_kernel_paths import assert_layer_through_kernel_equals_torch_path  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference64(o, gate, dy):
    """Value and (∂o, ∂gate) by autograd through the reference, in float64."""
    o64, g64 = (t.detach().double().requires_grad_() for t in (o, gate))
    out = sigmoid_gate_reference(o64, g64)
    out.backward(dy.double())
    return out, o64.grad, g64.grad


@pytest.mark.parametrize("lead,H,V,pad,dtype", [
    ((2, 5), 3, 32, 0, torch.float32),
    ((1, 37), 4, 40, 24, torch.float32),  # V not a power of two; o a slice of 64-wide heads (strided)
    ((3, 11), 12, 128, 64, torch.bfloat16),  # small's heads: 128 of 192 (v padded to q's head dim on CUDA)
    ((1, 1), 2, 16, 0, torch.bfloat16),  # one token (decode)
])
def test_gate_matches_float64_reference(lead, H, V, pad, dtype):
    gen = torch.Generator().manual_seed(H * V + pad)
    wide = (torch.randn(*lead, H, V + pad, generator=gen) * 2).to(DEVICE, dtype)
    o = wide[..., :V]  # strided when pad > 0
    before = wide.clone()
    assert o.is_contiguous() == (pad == 0)
    gate = (torch.randn(*lead, H * V, generator=gen) * 3).to(DEVICE, dtype)
    dy = torch.randn(*lead, H * V, generator=gen).to(DEVICE, dtype)
    o_leaf, g_leaf = o.detach().requires_grad_(), gate.detach().requires_grad_()
    out = _SigmoidGate.apply(o_leaf, g_leaf)
    out.backward(dy)
    want, d_o, d_g = reference64(o, gate, dy)
    assert out.shape == gate.shape and out.dtype == dtype
    assert o_leaf.grad.shape == o.shape and g_leaf.grad.shape == gate.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, got, ref in (("out", out, want), ("d_o", o_leaf.grad, d_o), ("d_gate", g_leaf.grad, d_g)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < tol, f"{name}: max error {err:.2e} of the largest value"
    assert torch.equal(wide, before)  # o, its padding columns included, only read


def test_mla_layer_through_the_kernel_equals_its_torch_path(monkeypatch):
    """A tiny MLA layer (float32) with the gate on the kernel (forced on for CPU tensors under the interpreter)
    against the same layer with it off: output, input and every parameter gradient."""
    assert_layer_through_kernel_equals_torch_path(monkeypatch, gate_mod, "_sigmoid_gate_triton", _SigmoidGate, DEVICE)
