"""Distributed Muon for replicated (non-FSDP) matrices on 2 and 4 gloo processes: every rank holds every matrix,
each matrix is orthogonalised once in all (by one owner, the work spread over the ranks) and the updates equal
single-process Muon over several steps. A K3 trained with data and expert parallelism (dense matrices spread over
all 4 ranks, expert shards over their 2 copies) follows one process."""
import pytest
import torch
from torch import nn

from k3.train.optim import build_optimizer, owner_ranks
from muon_cases import STEPS, CountedNewtonSchulz, assert_equal_single_process, assert_k3_follows_one_process, \
    grads, k3_steps, model
from parallel_harness import launch, make_model

SHAPES = [(16, 12), (12, 16), (7, 5), (3, 8), (9, 9), (5, 7), (2, 2)]  # uneven sizes and counts per rank


def worker(rank, world):
    net = model(SHAPES)
    opt = build_optimizer(net, "muon", lr=0.05, weight_decay=0.1)
    opt.spread_over({p: None for g in opt.param_groups if g["use_muon"] for p in g["params"]})
    with CountedNewtonSchulz() as ns:
        for step in range(STEPS):
            for n, p in net.named_parameters():
                p.grad = grads(SHAPES, step)[n]
            opt.step()
    # the 4-rank launch also trains K3 (each multi-process start costs seconds)
    return {"params": {n: p.detach() for n, p in net.named_parameters()}, "calls": ns.calls,
            "train": train(rank, world) if world == 4 else None}


_LAUNCHED: dict = {}


def launched(world: int) -> list:
    """The ranks' results of one launch per world size, shared by the tests of this module."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = launch(worker, world)
    return _LAUNCHED[world]


@pytest.fixture(scope="module", params=[2, 4])
def results(request, single_thread):
    return request.param, launched(request.param)


def test_updates_equal_single_process_muon(results):
    world, res = results
    assert_equal_single_process(SHAPES, [r["params"] for r in res])


def test_each_matrix_orthogonalised_once_by_its_owner(results):
    world, res = results
    every = sorted(c for rank in res for c in rank["calls"])
    assert every == sorted(SHAPES * STEPS)  # each matrix once per step over all ranks, not once per rank
    owner = owner_ranks([o * i for o, i in SHAPES], world)
    for r, rank in enumerate(res):
        assert sorted(rank["calls"]) == sorted([s for s, o in zip(SHAPES, owner) if o == r] * STEPS)
    per_rank = [len(rank["calls"]) // STEPS for rank in res]
    assert max(per_rank) - min(per_rank) <= 1  # spread: every rank does its share


def test_owner_ranks_round_robin_largest_first():
    assert owner_ranks([5, 100, 7, 50, 1], 2) == [1, 0, 0, 1, 0]  # order by size: 100, 50, 7, 5, 1
    assert owner_ranks([3, 3], 4) == [0, 1]
    assert owner_ranks([], 3) == []


def test_spread_over_rejects_a_parameter_muon_does_not_update():
    net = model(SHAPES)
    opt = build_optimizer(net, "muon", lr=0.05)
    norm = net[-1].weight  # 1-D: an AdamW parameter
    with pytest.raises(ValueError, match=r"\(2,\) parameter is not in a Muon group"):
        opt.spread_over({norm: None})
    with pytest.raises(ValueError, match="not in a Muon group"):
        opt.spread_over({nn.Parameter(torch.zeros(3, 3)): None})


def train(rank, world):
    from k3.parallel import ParallelDims, ParallelMesh
    from k3.parallel.parallelize import ParallelK3, full_state_dict
    model = make_model(0)
    runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=4, ep=2)))
    opt = build_optimizer(model, "muon", lr=0.02, weight_decay=0.1)
    runner.spread_muon(opt)
    muon = [(n, p) for n, p in model.named_parameters()
            if any(p is q for g in opt.param_groups if g["use_muon"] for q in g["params"])]
    def step(b):
        runner(**b).loss.backward()
        runner.sync_gradients()

    with CountedNewtonSchulz() as ns:
        k3_steps(step, model, opt)
    return {"state": full_state_dict(runner), "calls": len(ns.calls),
            "dense": sum(".experts.w" not in n for n, _ in muon), "experts": sum(".experts.w" in n for n, _ in muon)}


def test_dp_ep_training_with_spread_muon_equals_one_process(single_thread):
    res = [r["train"] for r in launched(4)]
    # dense matrices once over all 4 ranks, each rank's expert shards once over their 2 copies (ep=2)
    dense, experts = res[0]["dense"], res[0]["experts"]
    assert dense > 10 and experts > 0
    assert sum(r["calls"] for r in res) == 2 * (dense + 2 * experts)
    assert_k3_follows_one_process([r["state"] for r in res])
