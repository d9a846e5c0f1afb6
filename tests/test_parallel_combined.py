"""Data, expert and context parallelism together on 4 gloo processes (dp 2 × cp 2, experts over 2 or 4 ranks)
against one process in float64: logits and gradients, packed documents, replicas forced by hot experts."""
import pytest
import torch

from k3.parallel import ParallelDims, ParallelMesh
from k3.parallel.parallelize import ParallelK3
from parallel_harness import batch, launch, make_model

CASES = {"ep2-hot-docs": (2, [8, 9, 10, 11], True), "ep4": (4, None, False)}  # (ep, hot experts, packed docs)
B, T = 4, 7  # shards of 4 and 3 tokens


def worker(rank, world):
    res = {}
    for key, (ep, hot, docs) in CASES.items():
        model = make_model(0, hot_experts=hot)
        runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=2, ep=ep, cp=2)), ep_mode="balanced")
        out = runner(**batch(3, B, T, docs=docs))
        out.loss.backward()
        runner.sync_gradients()
        res[key] = {"logits": out.logits.detach(),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    "replicas": [h.last_plan.replicas for h in runner.moe_handles],
                    "processed": [h.last_plan.processed() for h in runner.moe_handles]}
    return res



@pytest.fixture(scope="module")
def results(single_thread):
    return launch(worker, 4)


@pytest.mark.parametrize("key", list(CASES))
def test_dp_ep_cp_match_single_process(results, key):
    ep, hot, docs = CASES[key]
    b = batch(3, B, T, docs=docs)
    model = make_model(0, hot_experts=hot)
    logits = model(b["input_ids"], doc_ids=b.get("doc_ids")).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100).backward()
    shards = [(0, 4), (4, 7)]
    per = 16 // ep
    for rank, res in enumerate(results):
        d, c = divmod(rank, 2)
        s, e = shards[c]
        torch.testing.assert_close(res[key]["logits"], logits[2 * d:2 * d + 2, s:e].detach(), rtol=1e-10, atol=1e-10)
        grads = res[key]["grads"]
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            want = p.grad[per * (rank % ep):per * (rank % ep + 1)] if ".experts.w" in n else p.grad
            torch.testing.assert_close(grads[n], want, rtol=1e-8, atol=1e-11, msg=n)


def test_plans_balance_the_expert_group(results):
    # ranks hold 2 rows × 4 or 3 tokens (8 or 6, top-4: 32 or 24 slots); balanced groups share them evenly
    for proc in results[0]["ep2-hot-docs"]["processed"]:
        assert proc == [28, 28]
    # the hot experts 8-11 live on rank 1 of each pair: rank 0 of the pair must replicate some of them
    assert all(set(rep[0]) and set(rep[0]) <= {8, 9, 10, 11} for rep in results[0]["ep2-hot-docs"]["replicas"])
    for proc in results[0]["ep4"]["processed"]:
        assert proc == [28, 28, 28, 28]
