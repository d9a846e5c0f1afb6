"""Newton–Schulz, Muon, the Muon/AdamW parameter split, and the WSD schedule."""

import copy

import pytest
import torch
from torch import nn

from k3.train.optim import Muon, MuonWithAdamW, build_optimizer, muon_scale, newton_schulz, param_role
from k3.train.schedule import apply_lr, wsd_multiplier

# Guaranteed band (see NS_COEFFS): singular values with sigma / ||G||_F >= 2e-3 land in [0.6, 1.25];
# none ever exceeds 1.25.
BAND = (0.6, 1.25)


def matrix_with_singular_values(sv, m, n, seed=0, batch=()):
    """U diag(sv) V^T with random orthogonal U, V: [*batch, m, n] with known singular values."""
    g = torch.Generator().manual_seed(seed)
    r = len(sv)
    U = torch.linalg.qr(torch.randn(*batch, m, r, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(*batch, n, r, generator=g, dtype=torch.float64))[0]
    return (U * torch.as_tensor(sv, dtype=torch.float64)) @ V.mT


def assert_in_band(G, X):
    """Check the guarantee in G's own singular basis: diag(U^T X V) are the mapped singular values."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    mapped = U.mT @ X.double() @ Vh.mT
    values = mapped.diagonal(dim1=-2, dim2=-1)
    # Same singular vectors: the off-diagonal part is only rounding.
    assert float((mapped - torch.diag_embed(values)).abs().max()) < 1e-3
    ratio = S / G.double().norm(dim=(-2, -1), keepdim=True)[..., 0]
    assert float(values.max()) <= BAND[1] and float(values.min()) >= -1e-3
    covered = values[ratio >= 2e-3]
    assert float(covered.min()) >= BAND[0] and float(covered.max()) <= BAND[1]
    return ratio


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (4, 48, 16), (3, 16, 40)])
def test_newton_schulz_random_matrices_in_band(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    X = newton_schulz(G)
    assert X.shape == G.shape and X.dtype == G.dtype
    ratio = assert_in_band(G, X)
    if shape[-2] != shape[-1]:  # rectangular Gaussians are well conditioned: every direction is covered
        assert float(ratio.min()) >= 2e-3
        sv = torch.linalg.svdvals(X.double())
        assert float(sv.min()) >= BAND[0] and float(sv.max()) <= BAND[1]


def test_newton_schulz_badly_conditioned():
    m, n = 48, 80
    # Condition number 100, with the smallest singular value just above the stated threshold.
    sv = torch.logspace(0, -2, 48)
    G = matrix_with_singular_values(sv, m, n).float()
    assert float(sv.min() / sv.norm()) > 2e-3
    out = torch.linalg.svdvals(newton_schulz(G).double())
    assert float(out.min()) >= BAND[0] and float(out.max()) <= BAND[1]
    # Tall and batched versions of the same matrices behave identically (transposition is exact).
    torch.testing.assert_close(newton_schulz(G.mT.contiguous()), newton_schulz(G).mT, atol=1e-5, rtol=0)
    batched = torch.stack([G, 3.0 * G, G.flip(0)])
    X = newton_schulz(batched)
    torch.testing.assert_close(X[1], newton_schulz(G), atol=1e-5, rtol=0)  # scale invariant
    torch.testing.assert_close(X[2], newton_schulz(G).flip(0), atol=1e-5, rtol=0)
    # Extreme conditioning: covered directions are in the band, tiny ones are never amplified past it.
    G = matrix_with_singular_values(torch.logspace(0, -7, 32), 32, 32, seed=2).float()
    ratio = assert_in_band(G, newton_schulz(G))
    assert float(ratio.min()) < 1e-6


def test_newton_schulz_matches_scalar_polynomial():
    # Independent reference: NS acts on each singular value by p(x) = a x + b x^3 + c x^5, 5 times.
    sv = torch.tensor([1.0, 0.5, 0.2, 0.05, 0.01], dtype=torch.float64)
    G = matrix_with_singular_values(sv, 12, 20, seed=3)
    x = sv / sv.norm()
    for _ in range(5):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    out = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float64))[:5]
    torch.testing.assert_close(out.sort().values, x.sort().values, atol=1e-6, rtol=1e-6)


def test_muon_reduces_least_squares_loss():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(256, 32, generator=g)
    W_true = torch.randn(16, 32, generator=g) * 0.5
    Y = A @ W_true.T
    W = nn.Parameter(torch.zeros(16, 32))
    stacked = nn.Parameter(torch.zeros(3, 16, 32))  # experts: each fits the same target
    opt = Muon([W, stacked], lr=0.2)

    def loss_fn():
        return ((A @ W.T - Y) ** 2).mean() + ((A @ stacked.mT - Y) ** 2).mean()

    first = float(loss_fn().detach())
    for step in range(100):
        # Muon's step length does not shrink with the gradient, so it needs the LR decay to settle.
        apply_lr(opt, wsd_multiplier(step, 100, 0, decay_fraction=0.5))
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert float(loss_fn().detach()) < 1e-2 * first


def test_muon_update_size_and_weight_decay():
    p = nn.Parameter(torch.ones(8, 32))
    opt = Muon([p], lr=0.1, weight_decay=0.5, nesterov=False, momentum=0.0)
    p.grad = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    expected = torch.ones(8, 32) * (1 - 0.1 * 0.5) - 0.1 * muon_scale(p.shape) * newton_schulz(p.grad)
    opt.step()
    torch.testing.assert_close(p.data, expected)
    # The scale makes an orthogonal update's RMS 0.2 (AdamW-like).
    Q = torch.linalg.qr(torch.randn(64, 16))[0]
    assert float((muon_scale(Q.shape) * Q).pow(2).mean().sqrt()) == pytest.approx(0.2, rel=1e-4)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        Muon([nn.Parameter(torch.ones(4))], lr=0.1)


class Leaf(nn.Module):
    def __init__(self, **params):
        super().__init__()
        for name, shape in params.items():
            setattr(self, name, nn.Parameter(torch.randn(*shape) * 0.1))


class FakeLayer(nn.Module):
    def __init__(self, D=16, E=4, L=8, with_moe=True):
        super().__init__()
        self.input_layernorm = Leaf(weight=(D,))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = Leaf(weight=(D, D))
        self.self_attn.o_proj = Leaf(weight=(D, D))
        self.self_attn.q_conv1d = Leaf(weight=(D, 1, 4))
        self.self_attn.A_log = nn.Parameter(torch.zeros(2))
        self.self_attn.dt_bias = nn.Parameter(torch.zeros(D))
        self.self_attention_res_proj = Leaf(weight=(1, D))
        self.self_attention_res_norm = Leaf(weight=(D,))
        if with_moe:
            self.block_sparse_moe = nn.Module()
            self.block_sparse_moe.gate = Leaf(weight=(E, D))
            self.block_sparse_moe.experts = Leaf(w1=(E, L, L), w2=(E, L, L), w3=(E, L, L))
            self.block_sparse_moe.shared_experts = nn.Module()
            self.block_sparse_moe.shared_experts.gate_proj = Leaf(weight=(2 * D, D))


class FakeModel(nn.Module):
    def __init__(self, V=50, D=16):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, D)
        self.model.layers = nn.ModuleList([FakeLayer(with_moe=False), FakeLayer()])
        self.model.norm = Leaf(weight=(D,))
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            a = layer.self_attn
            h = h + torch.tanh(h @ a.q_proj.weight.T) @ a.o_proj.weight.T * a.dt_bias * layer.input_layernorm.weight
            h = h + a.q_conv1d.weight.sum(-1)[:, 0] + layer.self_attention_res_proj.weight[0] + a.A_log.sum()
            if hasattr(layer, "block_sparse_moe"):
                moe = layer.block_sparse_moe
                s = torch.sigmoid(h @ moe.gate.weight.T)  # [.., E]
                z = h[..., :8]
                y = torch.einsum("...l,eol->...eo", z, moe.experts.w1 + moe.experts.w2 + moe.experts.w3)
                shared = (h @ moe.shared_experts.gate_proj.weight.T)[..., :16]
                h = h + torch.cat([(s[..., None] * y).sum(-2), z], -1) + shared
        return self.lm_head(h * self.model.norm.weight)


EXPECTED_ROLES = {
    "model.embed_tokens.weight": ("adamw", False),
    "lm_head.weight": ("adamw", True),
    "model.norm.weight": ("adamw", False),
    "model.layers.0.input_layernorm.weight": ("adamw", False),
    "model.layers.0.self_attn.q_proj.weight": ("muon", True),
    "model.layers.0.self_attn.o_proj.weight": ("muon", True),
    "model.layers.0.self_attn.q_conv1d.weight": ("adamw", True),
    "model.layers.0.self_attn.A_log": ("adamw", False),
    "model.layers.0.self_attn.dt_bias": ("adamw", False),
    "model.layers.0.self_attention_res_proj.weight": ("adamw", False),
    "model.layers.1.block_sparse_moe.gate.weight": ("adamw", True),
    "model.layers.1.block_sparse_moe.experts.w1": ("muon", True),
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ("muon", True),
}


def test_build_optimizer_groups():
    model = FakeModel()
    params = dict(model.named_parameters())
    for name, role in EXPECTED_ROLES.items():
        assert param_role(name, params[name]) == role, name
    opt = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, MuonWithAdamW)
    where = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert len(where) == len(params)  # every param exactly once
    for name, (kind, decay) in EXPECTED_ROLES.items():
        g = where[id(params[name])]
        assert g["use_muon"] == (kind == "muon"), name
        assert g["weight_decay"] == (0.1 if decay else 0.0), name
        assert g["base_lr"] == 1e-3
    adamw = build_optimizer(model, "adamw", lr=1e-3)
    assert isinstance(adamw, torch.optim.AdamW)
    no_decay = {id(p) for g in adamw.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert id(params["model.embed_tokens.weight"]) in no_decay
    assert id(params["model.layers.1.block_sparse_moe.experts.w1"]) not in no_decay


def test_build_optimizer_validation():
    model = FakeModel()
    with pytest.raises(ValueError, match="muon.*adamw"):
        build_optimizer(model, "sgd", lr=1e-3)
    with pytest.raises(ValueError, match="lr"):
        build_optimizer(model, lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(model, lr=1e-3, weight_decay=-0.1)


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 6), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten()).backward()
        opt.step()


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_state_dict_round_trip_is_bit_identical(name):
    torch.manual_seed(0)
    model = FakeModel()
    opt = build_optimizer(model, name, lr=1e-2)
    _train(model, opt, 3, seed=1)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, 2, seed=2)

    resumed = FakeModel()
    resumed.load_state_dict(saved_model)
    resumed_opt = build_optimizer(resumed, name, lr=1e-2)
    resumed_opt.load_state_dict(saved_opt)
    _train(resumed, resumed_opt, 2, seed=2)
    for (n, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n
    assert any(not torch.equal(a, saved_model[n]) for n, a in model.named_parameters())


def test_muon_keeps_float32_moments_for_bf16_params_on_load():
    p = nn.Parameter(torch.randn(8, 8).bfloat16())
    opt = Muon([p], lr=0.01)
    p.grad = torch.randn(8, 8).bfloat16()
    opt.step()
    opt2 = Muon([p], lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_wsd_shape():
    total, warm = 100, 10
    mult = [wsd_multiplier(s, total, warm, decay_fraction=0.2, final=0.1) for s in range(total + 1)]
    assert 0 < mult[0] <= 0.1
    assert all(a < b for a, b in zip(mult[:warm], mult[1:warm]))  # warmup strictly increasing
    assert all(m == 1.0 for m in mult[warm - 1 : 80])  # flat at 1 until the last 20%
    assert all(a > b for a, b in zip(mult[80:], mult[81:]))  # linear decay, strictly decreasing
    diffs = [a - b for a, b in zip(mult[80:], mult[81:])]
    assert max(diffs) - min(diffs) < 1e-12
    assert mult[total] == pytest.approx(0.1) and wsd_multiplier(500, total, warm, final=0.1) == pytest.approx(0.1)
    assert wsd_multiplier(99, 100, 0, final=0.0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="decay_fraction"):
        wsd_multiplier(0, 10, 1, decay_fraction=1.5)


def test_apply_lr_uses_base_lr():
    opt = build_optimizer(FakeModel(), "muon", lr=2e-3)
    apply_lr(opt, 0.5)
    apply_lr(opt, 0.25)  # multiplies base_lr, not the current lr
    assert all(g["lr"] == pytest.approx(5e-4) for g in opt.param_groups)
