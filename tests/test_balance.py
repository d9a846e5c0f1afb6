"""Quantile Balancing (exact and histogram), the sign rule, and the ExpertBalancer driver."""

import math

import pytest
import torch
from torch import nn

from k3.balance import (
    ExpertBalancer,
    QuantileHistogram,
    expert_load,
    max_violation,
    quantile_bias,
    route_topk,
    routing_margins,
    sign_bias_update,
)

N_EXPERTS, TOP_K = 16, 2


def skewed_scores(m, n=N_EXPERTS, seed=0, spread=2.0):
    """Sigmoid scores with strong per-expert offsets, so a zero bias is badly unbalanced."""
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) + torch.linspace(-spread, spread, n))


def reference_margins(scores, bias, k):
    """Cutoff by a plain sort per token, independent of route_topk."""
    biased = (scores + bias).double()
    cutoff = biased.sort(dim=1, descending=True).values[:, k]
    return cutoff[:, None] - scores.double()


def test_route_topk_matches_sort():
    s = skewed_scores(64)
    b = torch.randn(N_EXPERTS) * 0.1
    idx, cutoff = route_topk(s, b, TOP_K)
    order = (s + b).argsort(dim=1, descending=True)
    assert torch.equal(idx.sort(1).values, order[:, :TOP_K].sort(1).values)
    torch.testing.assert_close(cutoff, (s + b).sort(1, descending=True).values[:, TOP_K])
    # The margin rule reproduces the routes: b_j > r_ij exactly for the top-k (float64 keeps
    # (s + b) - s == b for float32 inputs, so the comparison is exact).
    r = routing_margins(s.double(), b.double(), TOP_K)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(b.double()[None, :] > r, chosen)


def test_exact_update_leaves_q_tokens_per_expert():
    m = 4096
    s = skewed_scores(m)
    b = torch.randn(N_EXPERTS, generator=torch.Generator().manual_seed(1)) * 0.05
    new = quantile_bias(s.double(), b.double(), TOP_K, centre=False)
    r = reference_margins(s.double(), b.double(), TOP_K)
    q = m * TOP_K // N_EXPERTS
    below = (r < new).sum(0)
    at_most = (r <= new).sum(0)
    # The token whose (k+1)-th expert is j has r_ij = b_j exactly, a tie the bias cannot split;
    # otherwise the count is exact.
    assert bool(((below <= q) & (q <= at_most)).all())
    untied = below == at_most
    assert untied.sum() >= N_EXPERTS // 2
    assert torch.equal(below[untied], torch.full_like(below[untied], q))


def test_exact_update_is_centred_and_shift_invariant():
    s = skewed_scores(1024)
    b = torch.randn(N_EXPERTS) * 0.1
    new = quantile_bias(s, b, TOP_K)
    assert new.dtype == b.dtype and new.shape == b.shape
    assert abs(float(new.mean())) < 1e-6
    # Routing ignores a common shift, so shifting the input bias cannot change the answer.
    torch.testing.assert_close(quantile_bias(s, b + 0.3, TOP_K), new, atol=1e-6, rtol=0)
    uncentred = quantile_bias(s, b, TOP_K, centre=False)
    torch.testing.assert_close(uncentred - uncentred.mean(), new, atol=1e-6, rtol=0)


def test_quantile_balancing_converges_on_fixed_skewed_batch():
    s = skewed_scores(4096, seed=3)
    b = torch.zeros(N_EXPERTS)
    history = []
    for _ in range(6):
        idx, _ = route_topk(s, b, TOP_K)
        history.append(max_violation(expert_load(idx, N_EXPERTS)))
        b = quantile_bias(s, b, TOP_K)
    assert history[0] > 2.0  # the offsets really unbalance the zero-bias routing
    assert min(history[3:]) < 0.1


def test_masked_tokens_are_excluded():
    s = skewed_scores(2048, seed=4)
    b = torch.zeros(N_EXPERTS)
    mask = torch.rand(2048, generator=torch.Generator().manual_seed(5)) < 0.6
    # Padding rows get junk scores that would shift every quantile if counted.
    junk = s.clone()
    junk[~mask] = torch.rand(int((~mask).sum()), N_EXPERTS)
    torch.testing.assert_close(quantile_bias(junk, b, TOP_K, mask=mask), quantile_bias(s[mask], b, TOP_K))
    h_masked, h_kept = QuantileHistogram(N_EXPERTS, TOP_K), QuantileHistogram(N_EXPERTS, TOP_K)
    h_masked.observe(junk, b, mask)
    h_kept.observe(s[mask], b)
    assert torch.equal(h_masked.pack(), h_kept.pack())
    with pytest.raises(ValueError, match="mask"):
        quantile_bias(s, b, TOP_K, mask=mask.float())


def test_histogram_agrees_with_exact_within_one_bin():
    s = skewed_scores(8192, seed=6)
    b = torch.randn(N_EXPERTS, generator=torch.Generator().manual_seed(7)) * 0.1
    h = QuantileHistogram(N_EXPERTS, TOP_K, bins=1000)
    h.observe(s, b)
    estimate = h.solve(centre=False).double()
    exact = quantile_bias(s, b.double(), TOP_K, centre=False)
    width = (float(b.max()) - float(b.min()) + 2.0) / 1000
    assert math.isclose(h.bin_width, width)
    assert float((estimate - exact).abs().max()) <= width
    centred = h.solve()
    assert abs(float(centred.mean())) < 1e-6


def test_histogram_over_micro_batches_equals_concatenated_batch():
    s = skewed_scores(4000, seed=8)
    b = torch.randn(N_EXPERTS) * 0.1
    whole, parts = QuantileHistogram(N_EXPERTS, TOP_K), QuantileHistogram(N_EXPERTS, TOP_K)
    whole.observe(s, b)
    for chunk in s.chunk(4):
        parts.observe(chunk, b)
    assert torch.equal(whole.pack(), parts.pack())
    assert int(parts.count) == 4000 and int(parts.hist.sum()) == 4000 * N_EXPERTS
    torch.testing.assert_close(whole.solve(), parts.solve())


def test_all_reduce_hook_is_applied():
    s = skewed_scores(2000, seed=9)
    b = torch.zeros(N_EXPERTS)
    h = QuantileHistogram(N_EXPERTS, TOP_K)
    h.observe(s, b)
    before = h.solve()
    packed_before = h.pack().clone()
    seen = []

    def double_in_place(t):  # stands in for a SUM all-reduce over two ranks holding the same tokens
        seen.append(t.dtype)
        t.mul_(2)

    h.all_reduce(double_in_place)
    assert seen == [torch.int64]
    assert torch.equal(h.pack(), packed_before * 2)
    torch.testing.assert_close(h.solve(), before)  # scaling all counts leaves the quantile unchanged
    # Two ranks with different tokens: summed histograms == histogram of all tokens.
    a, c, both = (QuantileHistogram(N_EXPERTS, TOP_K) for _ in range(3))
    a.observe(s[:700], b)
    c.observe(s[700:], b)
    both.observe(s, b)
    a.all_reduce(lambda t: t + c.pack())
    assert torch.equal(a.pack(), both.pack())


def test_sign_rule_moves_bias_toward_balance():
    load = torch.tensor([10, 2, 6, 6])
    bias = torch.tensor([0.5, 0.5, 0.5, 0.5])
    new = sign_bias_update(load, bias, gamma=0.01)
    torch.testing.assert_close(new, torch.tensor([0.49, 0.51, 0.5, 0.5]))
    assert max_violation(load) == pytest.approx(10 / 6 - 1)
    # Repeated sign steps lower MaxVio on a skewed batch.
    s = skewed_scores(2048, seed=10, spread=0.5)
    b = torch.zeros(N_EXPERTS)
    first = max_violation(expert_load(route_topk(s, b, TOP_K)[0], N_EXPERTS))
    for _ in range(200):
        b = sign_bias_update(expert_load(route_topk(s, b, TOP_K)[0], N_EXPERTS), b, gamma=2e-3)
    assert max_violation(expert_load(route_topk(s, b, TOP_K)[0], N_EXPERTS)) < 0.5 * first


def test_expert_load_counts():
    idx = torch.tensor([[0, 3], [3, 1], [3, 0]])
    assert expert_load(idx, 5).tolist() == [2, 1, 0, 3, 0]


class FakeGate(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(n))


class FakeMoE(nn.Module):
    """The duck-typed contract: gate bias, top_k, num_experts, last_scores/last_mask after forward."""

    def __init__(self, n=N_EXPERTS, k=TOP_K):
        super().__init__()
        self.gate = FakeGate(n)
        self.top_k, self.num_experts = k, n
        self.last_scores = self.last_mask = None
        self.used_bias = []  # bias each forward routed with

    def forward(self, scores, mask=None):
        self.used_bias.append(self.gate.e_score_correction_bias.clone())
        self.last_scores, self.last_mask = scores.detach().float(), mask
        return route_topk(scores, self.gate.e_score_correction_bias, self.top_k)[0]


class FakeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), FakeMoE(), FakeMoE(n=8, k=1)])


@pytest.mark.parametrize("exact", [True, False])
def test_expert_balancer_quantile_bias_used_only_from_next_batch(exact):
    model = FakeModel()
    moe_a, moe_b = model.layers[1], model.layers[2]
    bal = ExpertBalancer(model, mode="quantile", exact=exact)
    assert bal.layers == [moe_a, moe_b]
    batch = skewed_scores(4096, seed=11)
    batch_b = skewed_scores(4096, n=8, seed=12)
    for micro in range(4):  # four micro-batches of one step
        rows = slice(micro * 1024, (micro + 1) * 1024)
        moe_a(batch[rows])
        moe_b(batch_b[rows])
        bal.observe()
        assert moe_a.last_scores is None  # freed
        assert torch.equal(moe_a.gate.e_score_correction_bias, torch.zeros(N_EXPERTS))  # observe never updates
    metrics = bal.step()
    # Every micro-batch of step t was routed with the old (zero) bias.
    assert all(torch.equal(b, torch.zeros(N_EXPERTS)) for b in moe_a.used_bias)
    ref_load = expert_load(route_topk(batch, torch.zeros(N_EXPERTS), TOP_K)[0], N_EXPERTS)
    assert metrics["load"][0] == ref_load.tolist()
    assert metrics["maxvio"][0] == pytest.approx(max_violation(ref_load))
    assert metrics["maxvio_mean"] == pytest.approx(sum(metrics["maxvio"]) / 2)
    # The new bias is the exact update for the full step's batch (or its histogram estimate within a bin).
    reference = quantile_bias(batch, torch.zeros(N_EXPERTS), TOP_K)
    new = moe_a.gate.e_score_correction_bias
    assert float((new - reference).abs().max()) <= (1e-6 if exact else 2 * 2.0 / 1000)
    moe_a(batch)
    assert torch.equal(moe_a.used_bias[-1], new)  # first used by batch t+1
    bal.observe()
    assert bal.step()["maxvio"][0] < 0.5 * metrics["maxvio"][0]


def test_expert_balancer_single_all_reduce_and_modes():
    model = FakeModel()
    calls = []

    def fake_all_reduce(t):
        calls.append(t.dtype)
        t.mul_(3)  # three identical ranks

    bal = ExpertBalancer(model, mode="sign", gamma=0.01, all_reduce=fake_all_reduce)
    s = skewed_scores(512, seed=13)
    model.layers[1](s)
    bal.observe()  # layer 2 saw nothing this step
    metrics = bal.step()
    assert calls == [torch.int64]
    load = expert_load(route_topk(s, torch.zeros(N_EXPERTS), TOP_K)[0], N_EXPERTS)
    assert metrics["load"][0] == (3 * load).tolist()
    assert math.isnan(metrics["maxvio"][1]) and metrics["maxvio_mean"] == metrics["maxvio"][0]
    expected = sign_bias_update(load, torch.zeros(N_EXPERTS), 0.01)
    torch.testing.assert_close(model.layers[1].gate.e_score_correction_bias, expected)
    assert torch.equal(model.layers[2].gate.e_score_correction_bias, torch.zeros(8))

    frozen = FakeModel()
    bal = ExpertBalancer(frozen, mode="none")
    frozen.layers[1](s)
    bal.observe()
    metrics = bal.step()
    assert torch.equal(frozen.layers[1].gate.e_score_correction_bias, torch.zeros(N_EXPERTS))
    assert metrics["maxvio"][0] == pytest.approx(max_violation(load))
    with pytest.raises(ValueError, match="mode"):
        ExpertBalancer(frozen, mode="adaptive")


def test_argument_errors():
    s = skewed_scores(8)
    with pytest.raises(ValueError, match="k must"):
        route_topk(s, torch.zeros(N_EXPERTS), N_EXPERTS)
    with pytest.raises(ValueError, match="bias"):
        quantile_bias(s, torch.zeros(3), TOP_K)
