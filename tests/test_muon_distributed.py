"""Distributed Muon on 2 and 4 gloo processes, for row-sharded (FSDP2) and replicated matrices: the updates equal
single-process Muon over several steps (uneven shards and a rank holding no rows included), and each matrix is
orthogonalised exactly once in all, by one owner, with the work spread over the ranks. K3 trained with expert
parallelism beside FSDP2 (each rank's experts whole, the dense matrices sharded; 2 ranks), and with data and
expert parallelism (dense matrices spread over all 4 ranks, expert shards over their 2 copies), follows one
process. One launch per world size runs every case (a gloo start costs seconds a process)."""
import pytest
import torch
from torch import nn

from k3.train.optim import build_optimizer, owner_ranks
from muon_cases import STEPS, CountedNewtonSchulz, assert_equal_single_process, assert_k3_follows_one_process, \
    grads, k3_steps, model
from parallel_harness import launch, make_model

SHARDED_SHAPES = [(16, 12), (12, 16), (7, 5), (3, 8), (9, 9), (5, 7)]  # 3 rows over 4 ranks: the last holds none
REPLICATED_SHAPES = SHARDED_SHAPES + [(2, 2)]  # uneven sizes and counts per rank


def sharded_matrices(rank, world):
    """The matrix stack under FSDP2 (row shards), STEPS Muon steps on seeded gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    net = model(SHARDED_SHAPES)
    for layer in net[:-1]:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = build_optimizer(net, "muon", lr=0.05, weight_decay=0.1)
    with CountedNewtonSchulz() as ns:
        for step in range(STEPS):
            for n, p in net.named_parameters():
                p.grad = distribute_tensor(grads(SHARDED_SHAPES, step)[n], mesh, p.placements, src_data_rank=None)
            opt.step()
    return {"params": {n: p.full_tensor() for n, p in net.named_parameters()}, "calls": ns.calls,
            "sharded": all(hasattr(p, "full_tensor") for p in net.parameters())}


def replicated_matrices(rank, world):
    """The matrix stack whole on every rank, the Muon work spread over the ranks."""
    net = model(REPLICATED_SHAPES)
    opt = build_optimizer(net, "muon", lr=0.05, weight_decay=0.1)
    opt.spread_over({p: None for g in opt.param_groups if g["use_muon"] for p in g["params"]})
    with CountedNewtonSchulz() as ns:
        for step in range(STEPS):
            for n, p in net.named_parameters():
                p.grad = grads(REPLICATED_SHAPES, step)[n]
            opt.step()
    return {"params": {n: p.detach() for n, p in net.named_parameters()}, "calls": ns.calls}


def ep_with_fsdp_training(rank, world):
    from k3.parallel import ParallelDims, ParallelMesh
    from k3.parallel.parallelize import ParallelK3, full_state_dict
    model_ = make_model(0)
    runner = ParallelK3(model_, ParallelMesh(ParallelDims(dp=2, ep=2)), fsdp=True)
    opt = build_optimizer(model_, "muon", lr=0.02, weight_decay=0.1)
    sharded = sum(hasattr(p, "full_tensor") for g in opt.param_groups if g["use_muon"] for p in g["params"])

    def step(b):
        runner(**b).loss.backward()
        runner.sync_gradients()

    k3_steps(step, model_, opt)
    return {"state": full_state_dict(runner), "sharded_muon": sharded}


def dp_ep_training_with_spread_muon(rank, world):
    from k3.parallel import ParallelDims, ParallelMesh
    from k3.parallel.parallelize import ParallelK3, full_state_dict
    model_ = make_model(0)
    runner = ParallelK3(model_, ParallelMesh(ParallelDims(dp=4, ep=2)))
    opt = build_optimizer(model_, "muon", lr=0.02, weight_decay=0.1)
    runner.spread_muon(opt)
    muon = [(n, p) for n, p in model_.named_parameters()
            if any(p is q for g in opt.param_groups if g["use_muon"] for q in g["params"])]

    def step(b):
        runner(**b).loss.backward()
        runner.sync_gradients()

    with CountedNewtonSchulz() as ns:
        k3_steps(step, model_, opt)
    return {"state": full_state_dict(runner), "calls": len(ns.calls),
            "dense": sum(".experts.w" not in n for n, _ in muon), "experts": sum(".experts.w" in n for n, _ in muon)}


def worker(rank, world):
    """Every case of this module that runs on `world` ranks, one after the other in the same process group."""
    out = {"sharded": sharded_matrices(rank, world), "replicated": replicated_matrices(rank, world)}
    if world == 2:
        out["ep_fsdp"] = ep_with_fsdp_training(rank, world)
    if world == 4:
        out["dp_ep"] = dp_ep_training_with_spread_muon(rank, world)
    return out


_LAUNCHED: dict = {}


def launched(world: int) -> list:
    """The ranks' results of the one launch per world size, shared by the tests of this module."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = launch(worker, world)
    return _LAUNCHED[world]


@pytest.fixture(scope="module", params=[2, 4])
def results(request, single_thread):
    return request.param, launched(request.param)


def test_sharded_updates_equal_single_process_muon(results):
    world, res = results
    assert all(r["sharded"]["sharded"] for r in res)
    assert_equal_single_process(SHARDED_SHAPES, [r["sharded"]["params"] for r in res])


def test_each_sharded_matrix_orthogonalised_once_by_one_owner(results):
    world, res = results
    every = sorted(c for rank in res for c in rank["sharded"]["calls"])
    assert every == sorted(SHARDED_SHAPES * STEPS)  # whole matrices, each once per step over all ranks
    per_rank = [len(rank["sharded"]["calls"]) // STEPS for rank in res]
    assert max(per_rank) - min(per_rank) <= 1 and min(per_rank) >= len(SHARDED_SHAPES) // world  # round-robin


def test_replicated_updates_equal_single_process_muon(results):
    world, res = results
    assert_equal_single_process(REPLICATED_SHAPES, [r["replicated"]["params"] for r in res])


def test_each_replicated_matrix_orthogonalised_once_by_its_owner(results):
    world, res = results
    every = sorted(c for rank in res for c in rank["replicated"]["calls"])
    assert every == sorted(REPLICATED_SHAPES * STEPS)  # each matrix once per step over all ranks, not once per rank
    owner = owner_ranks([o * i for o, i in REPLICATED_SHAPES], world)
    for r, rank in enumerate(res):
        assert sorted(rank["replicated"]["calls"]) == sorted(
            [s for s, o in zip(REPLICATED_SHAPES, owner) if o == r] * STEPS)
    per_rank = [len(rank["replicated"]["calls"]) // STEPS for rank in res]
    assert max(per_rank) - min(per_rank) <= 1  # spread: every rank does its share


def test_owner_ranks_round_robin_largest_first():
    assert owner_ranks([5, 100, 7, 50, 1], 2) == [1, 0, 0, 1, 0]  # order by size: 100, 50, 7, 5, 1
    assert owner_ranks([3, 3], 4) == [0, 1]
    assert owner_ranks([], 3) == []


def test_spread_over_rejects_a_parameter_muon_does_not_update():
    net = model(REPLICATED_SHAPES)
    opt = build_optimizer(net, "muon", lr=0.05)
    norm = net[-1].weight  # 1-D: an AdamW parameter
    with pytest.raises(ValueError, match=r"\(2,\) parameter is not in a Muon group"):
        opt.spread_over({norm: None})
    with pytest.raises(ValueError, match="not in a Muon group"):
        opt.spread_over({nn.Parameter(torch.zeros(3, 3)): None})


def test_ep_with_fsdp_steps_equal_one_process(single_thread):
    res = [r["ep_fsdp"] for r in launched(2)]
    assert all(r["sharded_muon"] > 10 for r in res)  # the dense matrices really took the distributed path
    assert_k3_follows_one_process([r["state"] for r in res])


def test_dp_ep_training_with_spread_muon_equals_one_process(single_thread):
    res = [r["dp_ep"] for r in launched(4)]
    # dense matrices once over all 4 ranks, each rank's expert shards once over their 2 copies (ep=2)
    dense, experts = res[0]["dense"], res[0]["experts"]
    assert dense > 10 and experts > 0
    assert sum(r["calls"] for r in res) == 2 * (dense + 2 * experts)
    assert_k3_follows_one_process([r["state"] for r in res])
