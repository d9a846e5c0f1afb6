"""Memory-lean custom autograd for RMSNorm and the short conv equals autograd through the plain formulas, keeps
only the small tensors it claims for backward, and SiTUMLP dispatches through situ_glu_fast (the reference on CPU)."""
import pytest
import torch

import k3.model.mlp as mlp_mod
from k3 import K3Config
from k3.model.mlp import SiTUMLP
from k3.ops.conv import short_conv, short_conv_reference
from k3.ops.norm import rms_norm, rms_norm_reference
from k3.ops.situ import situ_glu


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def saved_storages(fn, *args) -> list[torch.Tensor]:
    """The distinct storages fn's autograd graph keeps for backward (one tensor each)."""
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return list(saved.values())


def grads_of(fn, inputs, grad_outs, need):
    """fn(*inputs) and the gradients of Σ⟨out, grad_out⟩ (outputs past grad_outs or with None get none)
    w.r.t. the inputs flagged in `need`."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(n) for t, n in zip(inputs, need)]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    wanted = [t for t, n in zip(leaves, need) if n]
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None]
    return outs, torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs])


# ---- RMSNorm ---------------------------------------------------------------------------------------------------
def norm_inputs(seed, shape, x_dtype, w_dtype):
    g = gen(seed)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(x_dtype)
    w = None if w_dtype is None else (1 + 0.4 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(w_dtype)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(x_dtype)
    return x, w, dy


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, None), (torch.bfloat16, None)])
@pytest.mark.parametrize("shape", [(7,), (3, 16), (2, 5, 64)])
def test_rms_norm_forward_is_bit_identical_to_the_formula(shape, x_dtype, w_dtype):
    x, w, _ = norm_inputs(0, shape, x_dtype, w_dtype)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == x_dtype and torch.equal(y, rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("seed,shape,eps", [(1, (5, 8), 1e-5), (2, (2, 3, 32), 1e-2), (3, (4, 1, 2, 17), 1e-6),
                                            (4, (1, 1), 1e-5), (5, (33,), 1e-3)])
@pytest.mark.parametrize("need_x,need_w", [(True, True), (True, False), (False, True)])
def test_rms_norm_float64_gradients_equal_autograd_of_the_formula(seed, shape, eps, need_x, need_w):
    x, w, dy = norm_inputs(seed, shape, torch.float64, torch.float64)
    (y, ), got = grads_of(lambda a, b: rms_norm(a, b, eps), (x, w), (dy,), (need_x, need_w))
    (y_ref, ), want = grads_of(lambda a, b: rms_norm_reference(a, b, eps), (x, w), (dy,), (need_x, need_w))
    assert torch.equal(y, y_ref) and len(got) == need_x + need_w
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_rms_norm_without_weight_and_with_nothing_to_differentiate():
    x, _, dy = norm_inputs(6, (3, 24), torch.float64, None)
    (_, ), (gx, ) = grads_of(lambda a: rms_norm(a, None, 1e-5), (x,), (dy,), (True,))
    (_, ), (gx_ref, ) = grads_of(lambda a: rms_norm_reference(a, None, 1e-5), (x,), (dy,), (True,))
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    y = rms_norm(x, torch.ones(24, dtype=torch.float64), 1e-5)  # frozen weight, plain input: no graph
    assert not y.requires_grad and torch.equal(y, rms_norm_reference(x, None, 1e-5))


@pytest.mark.parametrize("seed,w_dtype", [(7, torch.float32), (8, torch.bfloat16)])
def test_rms_norm_bf16_input_gradients_match_the_formula(seed, w_dtype):
    """bf16 activations with fp32 (master) or bf16 weights: fp32 compute, gradients in each input's dtype."""
    x, w, dy = norm_inputs(seed, (4, 6, 128), torch.bfloat16, w_dtype)
    _, (gx, gw) = grads_of(lambda a, b: rms_norm(a, b, 1e-5), (x, w), (dy,), (True, True))
    _, (gx_ref, gw_ref) = grads_of(lambda a, b: rms_norm_reference(a, b, 1e-5), (x, w), (dy,), (True, True))
    assert gx.dtype == torch.bfloat16 and gw.dtype == w_dtype
    # the same fp32 math in another order: at most a rounding apart
    torch.testing.assert_close(gx.float(), gx_ref.float(), rtol=1e-2, atol=1e-2 * float(gx_ref.abs().max()))
    torch.testing.assert_close(gw.float(), gw_ref.float(), rtol=1e-2 if w_dtype == torch.bfloat16 else 1e-5,
                               atol=1e-4 * float(gw_ref.abs().max()))


def test_rms_norm_keeps_only_the_input_and_row_rstd():
    x, w, _ = norm_inputs(9, (4, 16, 256), torch.bfloat16, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    saved = saved_storages(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    activations = [t for t in saved if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()]
    assert sum(t.untyped_storage().nbytes() for t in activations) == x.nbytes + 4 * 16 * 4  # x, fp32 rstd [4,16,1]
    reference = saved_storages(lambda a, b: rms_norm_reference(a, b, 1e-5), x, w)
    assert sum(t.untyped_storage().nbytes() for t in reference) > 3 * x.nbytes  # fp32 copies of x and x̂


# ---- short conv ------------------------------------------------------------------------------------------------
def conv_inputs(seed, B, T, C, W, dtype, tail: bool):
    g = gen(seed)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(C, 1, W, generator=g, dtype=wdt)
    t = torch.randn(B, W - 1, C, generator=g, dtype=wdt) if tail else None
    dy = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(dtype)
    dtail = torch.randn(B, W - 1, C, generator=g, dtype=wdt)
    return x, w, t, dy, dtail


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed,B,T,C,W,tail,packed", [(10, 2, 9, 6, 4, False, False), (11, 1, 2, 5, 4, True, False),
                                                      (12, 2, 7, 3, 2, True, True), (13, 3, 10, 4, 4, False, True),
                                                      (14, 1, 5, 8, 1, True, False)])
def test_short_conv_outputs_and_gradients_equal_the_reference(seed, B, T, C, W, tail, packed, dtype):
    """Same ops, recomputed in backward: bit-identical, also for the gradient that reaches the new tail."""
    x, w, t, dy, dtail = conv_inputs(seed, B, T, C, W, dtype, tail)
    doc = torch.randint(0, 3, (B, T), generator=gen(seed)).sort(-1).values if packed else None
    need = (True, True, tail)
    for grads_out in ((dy, dtail), (dy, None)):
        got_out, got = grads_of(lambda a, b, c: short_conv(a, b, c, doc), (x, w, t), grads_out, need)
        want_out, want = grads_of(lambda a, b, c: short_conv_reference(a, b, c, doc), (x, w, t), grads_out, need)
        for a, b in zip(got_out + got, want_out + want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_short_conv_stays_fp32_under_autocast(packed):
    """SPEC keeps the conv in fp32: under bf16 autocast (as the trainer runs on GPU) outputs and gradients
    equal the run without autocast, bit for bit."""
    x, w, _, dy, _ = conv_inputs(15, 2, 12, 16, 4, torch.float32, False)
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12]) if packed else None
    results = []
    for autocast in (True, False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, _ = short_conv(xs, ws, None, doc)
        results.append((y, *torch.autograd.grad(y, (xs, ws), dy)))
    for a, b in zip(*results):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_short_conv_keeps_the_input_in_its_own_dtype_not_an_fp32_padded_copy():
    x, w, _, _, _ = conv_inputs(16, 2, 64, 32, 4, torch.bfloat16, False)
    x.requires_grad_()
    saved = saved_storages(short_conv, x, w)
    assert sum(t.untyped_storage().nbytes() for t in saved if t is not w) == x.nbytes
    reference = saved_storages(short_conv_reference, x, w)
    assert sum(t.untyped_storage().nbytes() for t in reference) >= 2 * x.nbytes  # fp32 [B, T+W-1, C]
    _, tail = short_conv(x, w)
    assert tail.untyped_storage().nbytes() == tail.nbytes  # the carried tail holds no padded input alive


# ---- SiTU MLP --------------------------------------------------------------------------------------------------
def test_situ_mlp_dispatches_through_situ_glu_fast(monkeypatch):
    cfg = K3Config.preset("tiny")
    mlp = SiTUMLP(cfg, 32, 48).double()
    x = torch.randn(3, 5, 32, generator=gen(17), dtype=torch.float64)
    want = mlp.down_proj(situ_glu(mlp.gate_proj(x), mlp.up_proj(x), *mlp.betas))
    assert torch.equal(mlp(x), want)  # on CPU situ_glu_fast is the reference
    calls = []
    monkeypatch.setattr(mlp_mod, "situ_glu_fast", lambda g, u, b1, b2: calls.append((g, u, b1, b2)) or g * u)
    mlp(x)
    (g, u, b1, b2), = calls
    assert torch.equal(g, mlp.gate_proj(x)) and torch.equal(u, mlp.up_proj(x))
    assert (b1, b2) == (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
