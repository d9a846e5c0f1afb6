"""Context parallelism on 2 gloo processes against one process (float64): logits and gradients for sequence
lengths that do not divide evenly (including shards shorter than the conv halo) and for packed documents
(several a row, and one a row);
a sequence shorter than the CP size fails with a clear message on every rank."""
import pytest
import torch

from k3.parallel import ParallelDims, ParallelMesh
from k3.parallel.parallelize import ParallelK3
from parallel_harness import batch, launch, make_model

# (seq_len, packed documents): 11 → shards of 6 and 5; 3 → 2 and 1, so rank 1's halo spans a short shard
CASES = {"T11": (11, False), "T11-docs": (11, True), "T11-one-doc": (11, "one"), "T3": (3, False)}


def worker(rank, world):
    res = {}
    mesh = ParallelMesh(ParallelDims(dp=1, cp=2))
    for key, (T, docs) in CASES.items():
        model = make_model(0)
        runner = ParallelK3(model, mesh)
        out = runner(**batch(2, 2, T, docs=docs))
        out.loss.backward()
        runner.sync_gradients()
        res[key] = {"logits": out.logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                                             if p.grad is not None}}
    # the same with FSDP2 sharding the dense parameters over both ranks
    from k3.parallel.fsdp import full_gradients
    model = make_model(0)
    runner = ParallelK3(model, mesh, fsdp=True)
    out = runner(**batch(2, 2, 11, docs=True))
    out.loss.backward()
    runner.sync_gradients()
    res["T11-docs-fsdp"] = {"logits": out.logits.detach(), "grads": {n: g.clone() for n, g in full_gradients(model).items()},
                            "sharded": sum(hasattr(p, "full_tensor") for p in model.parameters())}
    try:
        runner(**batch(2, 2, 1))
        res["too_short"] = None
    except ValueError as e:
        res["too_short"] = str(e)
    return res



@pytest.fixture(scope="module")
def results(single_thread):
    return launch(worker, 2)


@pytest.mark.parametrize("key", list(CASES) + ["T11-docs-fsdp"])
def test_context_parallel_matches_single_process(results, key):
    T, docs = CASES.get(key, (11, True))
    b = batch(2, 2, T, docs=docs)
    model = make_model(0)
    logits = model(b["input_ids"], doc_ids=b.get("doc_ids")).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
    loss.backward()
    got = torch.cat([r[key]["logits"] for r in results], dim=1)
    torch.testing.assert_close(got, logits.detach(), rtol=1e-10, atol=1e-10)
    for res in results:
        grads = res[key]["grads"]
        assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-8, atol=1e-11, msg=n)


def test_fsdp_shards_every_dense_parameter(results):
    model = make_model(0)
    dense = sum(".experts.w" not in n for n, _ in model.named_parameters())
    assert results[0]["T11-docs-fsdp"]["sharded"] == dense


def test_sequence_shorter_than_cp_fails_clearly(results):
    for res in results:
        assert res["too_short"] is not None and "--cp 2" in res["too_short"] and "sequence length 1" in res["too_short"]
