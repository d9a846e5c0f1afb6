"""MLA's keys `[k_nope, k_extra]` per head in one Triton pass each way (k3.ops._mla_keys_triton) against the torch
reference in float64: k_extra strided (a slice of kv_a_proj's output, as the layer hands it), widths off the block
sizes, bf16, leading dims that do not merge; and the MLA layer through the kernel against its torch path. On CUDA
the kernels run natively; on a CPU with triton installed under the interpreter; without triton the module is
skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3.ops import mla_keys as keys_mod  # noqa: E402
from k3.ops.mla_keys import _MlaKeys, mla_keys_reference  # noqa: E402

from mla_kernel_paths import assert_layer_through_kernel_equals_torch_path  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference64(kv, k_extra, nope, dk, dv):
    """Keys, values and (∂kv, ∂k_extra) by autograd through the reference, in float64."""
    kv64, ke64 = (t.detach().double().requires_grad_() for t in (kv, k_extra))
    k, v = mla_keys_reference(kv64, ke64, nope)
    torch.autograd.backward([k, v], [dk.double(), dv.double()])
    return k, v, kv64.grad, ke64.grad


@pytest.mark.parametrize("lead,H,nope,vd,rope,latent,dtype", [
    ((2, 5), 3, 32, 32, 16, 8, torch.float32),  # tiny's widths
    ((1, 37), 4, 40, 24, 12, 0, torch.float32),  # none a power of two; k_extra contiguous
    ((3, 11), 12, 128, 128, 64, 256, torch.bfloat16),  # small's heads
    ((1, 1), 2, 16, 48, 8, 4, torch.bfloat16),  # one token (decode's prefill of one)
    ((2, 3, 7), 2, 8, 8, 4, 4, torch.float64),
])
def test_keys_match_float64_reference(lead, H, nope, vd, rope, latent, dtype):
    gen = torch.Generator().manual_seed(H * nope + rope + latent)
    kv = (torch.randn(*lead, H * (nope + vd), generator=gen) * 2).to(DEVICE, dtype).unflatten(-1, (H, nope + vd))
    kv_a = torch.randn(*lead, latent + rope, generator=gen).to(DEVICE, dtype)
    k_extra = kv_a[..., latent:]
    assert k_extra.stride(-2) == latent + rope  # strided when latent > 0
    before = kv_a.clone()
    dk = torch.randn(*lead, H, nope + rope, generator=gen).to(DEVICE, dtype)
    dv = torch.randn(*lead, H, vd, generator=gen).to(DEVICE, dtype)
    kv_leaf, ke_leaf = kv.detach().requires_grad_(), k_extra.detach().requires_grad_()
    k, v = _MlaKeys.apply(kv_leaf, ke_leaf, nope)
    assert v.data_ptr() == kv_leaf.data_ptr() + nope * kv.element_size()  # the values a view, not a copy
    torch.autograd.backward([k, v], [dk, dv])
    want_k, want_v, d_kv, d_ke = reference64(kv, k_extra, nope, dk, dv)
    assert k.shape == want_k.shape and k.dtype == dtype and k.is_contiguous()
    assert torch.equal(k.double(), want_k) and torch.equal(v.double(), want_v)  # copies: exact
    assert kv_leaf.grad.shape == kv.shape and ke_leaf.grad.shape == k_extra.shape
    assert torch.equal(kv_leaf.grad.double(), d_kv)  # a copy of dk's and dv's parts: exact
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    err = (ke_leaf.grad.double() - d_ke).abs().max() / d_ke.abs().max()
    assert err < tol, f"∂k_extra: max error {err:.2e} of the largest value"
    assert torch.equal(kv_a, before)  # k_extra's source, its latent columns included, only read


def test_gradients_through_strided_upstream_grads():
    """∂L/∂k and ∂L/∂v with non-unit head strides (slices of wider tensors) are read as they are."""
    gen = torch.Generator().manual_seed(7)
    H, nope, vd, rope = 3, 16, 8, 4
    kv = torch.randn(5, H, nope + vd, generator=gen).to(DEVICE)
    k_extra = torch.randn(5, rope, generator=gen).to(DEVICE)
    dk = torch.randn(5, H, nope + rope + 6, generator=gen).to(DEVICE)[..., 3:3 + nope + rope]
    dv = torch.randn(5, H + 2, vd, generator=gen).to(DEVICE)[:, 1:1 + H]
    kv_leaf, ke_leaf = kv.clone().requires_grad_(), k_extra.clone().requires_grad_()
    torch.autograd.backward(list(_MlaKeys.apply(kv_leaf, ke_leaf, nope)), [dk, dv])
    _, _, d_kv, d_ke = reference64(kv, k_extra, nope, dk, dv)
    assert torch.equal(kv_leaf.grad.double(), d_kv)
    torch.testing.assert_close(ke_leaf.grad.double(), d_ke, rtol=1e-6, atol=1e-6)


def test_selector_takes_the_torch_path_off_the_kernel():
    """On CPU tensors (and whatever the kernel does not take) `mla_keys` is the reference itself."""
    kv = torch.randn(2, 3, 4, 12)
    k_extra = torch.randn(2, 3, 5)
    k, v = keys_mod.mla_keys(kv, k_extra, 8)
    want_k, want_v = mla_keys_reference(kv, k_extra, 8)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_mla_layer_through_the_kernel_equals_its_torch_path(monkeypatch):
    """A tiny MLA layer (float32) with its keys on the kernel (forced on for CPU tensors under the interpreter)
    against the same layer with it off: output, input and every parameter gradient."""
    assert_layer_through_kernel_equals_torch_path(monkeypatch, keys_mod, "_mla_keys_triton", _MlaKeys, DEVICE)
