"""Expert parallelism on 2 gloo processes against one process (float64): logits and gradients in plain and
MoonEP-balanced modes (with replicas forced by adversarial routing), a short training run with Quantile
Balancing over the ranks, and the all-reduced QB histogram against the histogram of the gathered batch."""
import pytest
import torch
import torch.distributed as dist

from k3.balance import ExpertBalancer, QuantileHistogram
from k3.parallel import ParallelDims, ParallelMesh
from k3.parallel.parallelize import ParallelK3
from parallel_harness import batch, launch, make_model

CASES = {"plain": ("plain", None), "balanced": ("balanced", None), "balanced-hot": ("balanced", [0, 1, 2, 3]),
         "plain-hot": ("plain", [0, 1, 2, 3])}
TRAIN_STEPS = 4


def train_batches():
    """One batch seen repeatedly: its loss must fall, so following the curve is not a flat-line match."""
    return [batch(100, 4, 9)] * TRAIN_STEPS


def qb_scores(rank):
    """Different tokens per rank (and a different count), the same routing bias everywhere."""
    g = torch.Generator().manual_seed(50 + rank)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(49)) * 0.05
    return torch.rand(40 + 7 * rank, 16, generator=g, dtype=torch.float64), bias


def worker(rank, world):
    res = {}
    for key, (mode, hot) in CASES.items():
        model = make_model(0, hot_experts=hot)
        runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=2, ep=2)), ep_mode=mode)
        out = runner(**batch(1, 4, 11))
        out.loss.backward()
        runner.sync_gradients()
        res[key] = {"logits": out.logits.detach(), "loss": runner.global_sum(float(out.loss.detach())),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    "plans": [(h.last_plan.processed(), h.last_plan.replicas, h.last_plan.donor)
                              for h in runner.moe_handles]}

    model = make_model(0)
    runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=2, ep=2)), ep_mode="balanced")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    balancer = ExpertBalancer(model, "quantile", all_reduce=runner.all_reduce_counts)
    losses = []
    for b in train_batches():
        out = runner(**b)
        out.loss.backward()
        runner.sync_gradients()
        balancer.observe()
        opt.step()
        opt.zero_grad()
        balancer.step()
        losses.append(runner.global_sum(float(out.loss.detach())))
    res["train"] = {"losses": losses, "bias": [m.gate.e_score_correction_bias.clone() for m in balancer.layers]}

    scores, bias = qb_scores(rank)
    hist = QuantileHistogram(16, 4, bins=200)
    hist.observe(scores, bias)
    hist.all_reduce(lambda t: dist.all_reduce(t))
    res["qb"] = hist.solve()
    return res



@pytest.fixture(scope="module")
def results(single_thread):
    return launch(worker, 2)


def f64_loss(model, b):
    """The model's own loss is taken in float32; the float64 comparisons need it in float64."""
    logits = model(b["input_ids"]).logits
    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


def reference(hot, b):
    model = make_model(0, hot_experts=hot)
    logits, loss = f64_loss(model, b)
    loss.backward()
    return logits.detach(), float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("key", list(CASES))
def test_expert_parallel_matches_single_process(results, key):
    mode, hot = CASES[key]
    logits, loss, grads = reference(hot, batch(1, 4, 11))
    for r, res in enumerate(results):
        got = res[key]
        torch.testing.assert_close(got["logits"], logits[2 * r:2 * r + 2], rtol=1e-10, atol=1e-10)
        assert got["loss"] == pytest.approx(loss, rel=1e-12)
        assert set(got["grads"]) == set(grads)
        for name, g in grads.items():
            if ".experts.w" in name:  # rank r holds experts 8r..8r+7
                torch.testing.assert_close(got["grads"][name], g[8 * r:8 * r + 8], rtol=1e-9, atol=1e-12)
            else:
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-9, atol=1e-12)


def test_balanced_plans_equalise_slots_and_replicate(results):
    # 4 rows × 11 tokens, 2 rows per rank, top-4: S×K = 22 × 4 = 88 slots per rank
    for key in ("balanced", "balanced-hot"):
        for processed, replicas, donor in results[0][key]["plans"]:
            assert processed == [88, 88]
    hot_plans = results[0]["balanced-hot"]["plans"]
    # every token picks experts 0-3, all homed on rank 0: rank 1 must replicate them from rank 0
    # rank 0 keeps the first half of its 176 slots (experts 0, 1) and hands 2, 3 to rank 1
    assert all(rep[1] == [2, 3] and don[1] == 0 and rep[0] == [] for _, rep, don in hot_plans)
    assert all(proc == [176, 0] for proc, _, _ in results[0]["plain-hot"]["plans"])


def test_ep_training_follows_single_process(results):
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    balancer = ExpertBalancer(model, "quantile", exact=False)  # the histogram the ranks all-reduce
    losses = []
    for b in train_batches():
        _, loss = f64_loss(model, b)
        loss.backward()
        balancer.observe()
        opt.step()
        opt.zero_grad()
        balancer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]  # it is learning, so the comparison means something
    for res in results:
        assert res["train"]["losses"] == pytest.approx(losses, rel=1e-8)
        for got, layer in zip(res["train"]["bias"], balancer.layers):
            torch.testing.assert_close(got, layer.gate.e_score_correction_bias, rtol=1e-6, atol=1e-6)


def test_quantile_histogram_all_reduce_equals_gathered_batch(results):
    s0, bias = qb_scores(0)
    s1, _ = qb_scores(1)
    hist = QuantileHistogram(16, 4, bins=200)
    hist.observe(torch.cat([s0, s1]), bias)
    expected = hist.solve()
    for res in results:
        assert torch.equal(res["qb"], expected)
