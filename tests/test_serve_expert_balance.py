"""Balanced expert replicas in expert-parallel serving (k3.serve.expert_balance, k3.serve.expert_shard): under
routing skewed by a router bias, the split of each expert's slots between its holders matches a per-expert loop,
gives every rank its planned share to within one slot per expert it holds, and the ranks' partial sums with
replicas (float and packed MXFP4) still add to the one-process routed output; two gloo ranks serving with
--ep-replicas give the single-process engine's tokens and logprobs with the expert rows balanced; hostile flags
and placements are refused."""

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint.sharded import RankLayout
from k3.cli import main
from k3.data import Tokenizer
from k3.model.moe import LatentMoE
from k3.serve import LLMEngine
from k3.serve.expert_balance import SCALE, ReplicaPlacement, home_ranks, place_replicas, slot_holders
from k3.serve.expert_shard import load_rank_model
from k3.serve.local_server import free_port
from parallel_harness import launch
from random_model import randomize_trivial_parts
from serve_distributed_job import assert_same_serving, engine_config, serve_or_follow, workload

E, K = 16, 4  # the tiny preset's routed experts and top-k
HOT = [0, 1]  # both homed on rank 0 for 2 and 4 ranks: every token picks them


def skewed_routing(n: int, seed: int = 0, hot: list[int] = HOT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(E)
    bias[hot] = 10.0
    return torch.topk(torch.rand(n, E, generator=g) + bias, K).indices


def holders_reference(idx: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """The split one expert at a time: of its c slots (token order) ranks ≤ j take the first ⌊cut[e,j]·c/SCALE⌋."""
    out = torch.empty_like(idx).flatten()
    flat = idx.flatten().tolist()
    for e in range(cut.shape[0]):
        slots = [s for s, x in enumerate(flat) if x == e]
        bounds = [int(b) * len(slots) // SCALE for b in cut[e]]
        for p, s in enumerate(slots):
            out[s] = next(j for j, b in enumerate(bounds) if b > p)
    return out.view(idx.shape)


@pytest.mark.parametrize("ranks, cap", [(2, 2), (4, 2), (4, 4)])
def test_split_gives_each_rank_its_share(ranks, cap):
    idx = skewed_routing(1024)
    load = torch.bincount(idx.flatten(), minlength=E)
    p = place_replicas(load, ranks, cap)
    holder = slot_holders(idx, p.cut)
    assert torch.equal(holder, holders_reference(idx, p.cut))
    home = home_ranks(E, ranks)
    held = [set(range(r * E // ranks, (r + 1) * E // ranks)) | set(p.replicas[r]) for r in range(ranks)]
    assert all(e in held[r] for e, r in zip(idx.flatten().tolist(), holder.flatten().tolist()))
    assert all(len(r) <= cap for r in p.replicas) and any(p.replicas)
    rows = torch.bincount(holder.flatten(), minlength=ranks)
    # the plan gives each rank ⌈N/R⌉ slots at most; each expert's cut points are floors, so a rank takes at most one
    # slot more than planned of each expert it holds with a share
    N = idx.numel()
    holding = (p.share > 0).sum(0)
    assert torch.equal(p.share.sum(0).max(), torch.tensor(-(-N // ranks)))
    assert bool((rows <= -(-N // ranks) + holding).all()), (rows, holding)
    # without replicas the rank holding the hot experts does 1/R of their 2 slots of 4 and more
    plain = torch.bincount(home[idx].flatten(), minlength=ranks)
    assert plain.max() / plain.float().mean() > 1.4 and rows.max() / rows.float().mean() < 1.02


def test_placement_caps_and_edges():
    idx = skewed_routing(1024)
    load = torch.bincount(idx.flatten(), minlength=E)
    one = place_replicas(load, 4, 1)
    assert all(len(r) <= 1 for r in one.replicas) and torch.equal(one.share.sum(1), load)
    none = place_replicas(load, 4, 0)
    assert none.replicas == [[]] * 4 and torch.equal(slot_holders(idx, none.cut), home_ranks(E, 4)[idx])
    cold = torch.zeros(E, dtype=torch.long)
    assert torch.equal(slot_holders(idx, place_replicas(cold, 2, 2).cut), home_ranks(E, 2)[idx])
    for bad, message in [(lambda: place_replicas(load, 3, 1), "3 ranks must divide the 16 experts"),
                         (lambda: place_replicas(load.float(), 2, 1), "non-negative integer"),
                         (lambda: place_replicas(-load, 2, 1), "non-negative integer"),
                         (lambda: place_replicas(load, 2, -1), "cap must be an integer >= 0")]:
        with pytest.raises(ValueError, match=message):
            bad()


@pytest.fixture(scope="module")
def hot_model_dir(tmp_path_factory):
    """The tiny model with its router biased towards experts 0 and 1 in every MoE layer, float32 and MXFP4."""
    root = tmp_path_factory.mktemp("hot")
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=0)
    randomize_trivial_parts(model, torch.Generator().manual_seed(1), bias_scale=0.05)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b[HOT] += 10.0
    for fmt, experts in (("f32", None), ("mxfp4", "mxfp4")):
        kw = {"experts": experts} if experts else {}
        model.save_pretrained(root / fmt, dtype=None, max_shard_bytes=400_000, **kw)
        Tokenizer.from_file().save_pretrained(root / fmt)
    return root


def _moe(model) -> LatentMoE:
    return next(m for m in model.modules() if isinstance(m, LatentMoE))


@pytest.mark.parametrize("fmt", ["f32", "mxfp4"])
def test_partials_with_replicas_sum_to_the_full_combine(hot_model_dir, fmt):
    """Each rank's share with replicas installed (their weights taken from the home ranks' rows, as the
    all-to-all of `rebalance` moves them) adds up to the one-process routed sum; the replica holders really compute."""
    g = torch.Generator().manual_seed(3)
    moe = _moe(K3ForCausalLM.from_pretrained(hot_model_dir / fmt).eval())
    idx = skewed_routing(64, seed=5)
    z = torch.randn(64, moe.routed_expert_down_proj.out_features, generator=g)
    w = torch.rand(64, K, generator=g)
    want = moe.combine_experts(z, idx, w)
    ranks = 4
    combines = [_moe(load_rank_model(hot_model_dir / fmt, RankLayout(r, ranks), replicas=2)).combine_experts
                for r in range(ranks)]
    assert all(c.local.experts.packed == (fmt == "mxfp4") for c in combines)

    def place(p):  # each rank's missing replicas from their home ranks, as `rebalance`'s all-to-all brings them
        fresh = [c.fresh(p) for c in combines]
        for c, f in zip(combines, fresh):
            c.install(p, torch.cat([combines[e // (E // ranks)].replica_rows([e]) for e in f]) if f else None)
        return sum(map(len, fresh))

    p = place_replicas(torch.bincount(idx.flatten(), minlength=E), ranks, 2)
    assert place(p) == sum(map(len, p.replicas)) > 0
    for mode in ("sparse", "masked"):
        for c in combines:
            c.mode = mode
        parts = [c.partial(z, idx, w) for c in combines]
        torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6)
    rows = torch.stack([c.rows for c in combines]) // 2  # counted once per mode
    assert rows.max() <= -(-idx.numel() // ranks) + (p.share > 0).sum(0).max()
    assert torch.equal(combines[0].seen, 2 * torch.bincount(idx.flatten(), minlength=E))
    # the hot experts move to rank 1 (experts 4, 5) and rank 2 (8): kept replicas stay, only new ones are fetched
    idx2 = skewed_routing(64, seed=6, hot=[4, 5, 8])
    p2 = place_replicas(torch.bincount(idx2.flatten(), minlength=E), ranks, 2)
    kept = sum(len(set(a) & set(b)) for a, b in zip(p.replicas, p2.replicas))
    assert place(p2) == sum(map(len, p2.replicas)) - kept
    torch.testing.assert_close(sum(c.partial(z, idx2, w) for c in combines), moe.combine_experts(z, idx2, w),
                               rtol=1e-5, atol=1e-6)


def test_a_placement_without_room_is_refused(hot_model_dir):
    c = _moe(load_rank_model(hot_model_dir / "f32", RankLayout(1, 2), replicas=1)).combine_experts
    p = ReplicaPlacement(torch.zeros(E, 2, dtype=torch.long), torch.zeros(E, 2, dtype=torch.long), [[], [0, 1]])
    with pytest.raises(ValueError, match="gives rank 1 2 replicas; it has room for 1"):
        c.install(p, None)


def replica_job(rank: int, world: int, model_dir: str, fmts: list[str]) -> list:
    from k3.serve.distributed import ServeLayout, build_rank_engine

    out = []
    for fmt in fmts:
        engine = build_rank_engine(f"{model_dir}/{fmt}", ServeLayout(world, world, 1, replicas=2, rebalance_steps=4),
                                   engine_config())
        got = serve_or_follow(engine, rank)
        combines = engine.balancer.combines
        out.append({"got": got, "placements": engine.balancer.placements,
                    "rows": sum(int(c.rows) for c in combines), "seen": sum(c.seen for c in combines),
                    "replicas": [c.placement.replicas[rank] for c in combines],
                    "fetched": sum(c.fetched for c in combines), "room": sum(c.replicas for c in combines)})
    return out


def test_two_ranks_with_replicas_equal_one_process(hot_model_dir):
    fmts = ["mxfp4"]  # packed replicas cross as bytes and scales; float ones are checked above without processes
    results = launch(replica_job, 2, str(hot_model_dir), fmts)
    for i, fmt in enumerate(fmts):
        single = workload(LLMEngine(K3ForCausalLM.from_pretrained(hot_model_dir / fmt).eval(), Tokenizer.from_file(),
                                    engine_config()))
        r0, r1 = results[0][i], results[1][i]
        assert_same_serving(r0["got"], single)
        assert r0["placements"] == r1["placements"] > 3
        assert torch.equal(r0["seen"], r1["seen"])  # both ranks counted the same routing
        assert any(HOT[0] in r or HOT[1] in r for r in r1["replicas"])  # rank 1 holds hot experts of rank 0
        assert 0 < r1["fetched"] < r1["room"] * r1["placements"] / 2  # kept replicas are not fetched again
        rows = torch.tensor([r0["rows"], r1["rows"]], dtype=torch.float64)
        assert rows.sum() == r0["seen"].sum()  # every slot computed once
        home = torch.stack([r0["seen"][:E // 2].sum(), r0["seen"][E // 2:].sum()]).double()
        # every token picks both hot experts (rank 0's): without replicas rank 0 computes over 2 of each token's
        # 4 slots plus its share of the others; with them the first 4 steps are home-only and later steps follow
        # the previous window's load
        assert home.max() / home.mean() > 1.35 and rows.max() / rows.mean() < 1.15, (home, rows)


@pytest.mark.parametrize("flags, message", [
    (["--ep-replicas", "2"], "--ep-replicas 2: replicas balance expert parallelism"),
    (["--nproc", "2", "--ep", "1", "--ep-replicas", "1"], "has one rank per expert group (--ep 1)"),
    (["--nproc", "2", "--ep-replicas", "9"], "--ep-replicas 9 exceeds the 8 experts each rank owns"),
    (["--nproc", "2", "--ep-rebalance-steps", "8"], "--ep-rebalance-steps 8: there are no replicas to re-place"),
    (["--nproc", "2", "--ep-replicas", "0"], "--ep-replicas: must be >= 1, got 0"),
    (["--nproc", "2", "--ep-replicas", "-1"], "--ep-replicas: must be >= 1, got -1"),
    (["--nproc", "2", "--ep-replicas", "2", "--ep-rebalance-steps", "0"], "must be >= 1, got 0"),
])
def test_hostile_replica_flags_are_refused(hot_model_dir, capsys, flags, message):
    rc = main(["serve", "--model", str(hot_model_dir / "f32"), "--port", str(free_port()), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_expert_shares_follow_the_plan():
    """planner's per-expert shares add up to each expert's load and to the slots its plan gives each rank."""
    from k3.parallel.planner import balanced_plan
    load = torch.bincount(skewed_routing(512).flatten(), minlength=E)
    plan = balanced_plan(load, 4)
    shares = plan.expert_shares()
    assert torch.equal(shares.sum(1), load)
    assert shares.sum(0).tolist() == plan.to_plan().processed()


def capture_partials(combines, z, idx, w) -> tuple[list, list]:
    """Each rank's share `c.partial(z, idx, w)` warmed up on a side stream, then captured as a CUDA graph:
    (graphs, their output tensors). Call under inference_mode."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in combines:
            c.partial(z, idx, w)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for c in combines:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(c.partial(z, idx, w))
        graphs.append(graph)
    return graphs, outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["f32", "mxfp4"])
def test_replicas_decode_in_a_cuda_graph(hot_model_dir, fmt):
    """Two ranks' shares with replicas, captured as CUDA graphs (the masked path: no host read), replayed on new
    routing and again after a re-placement (tables and replica rows change in place), add to the routed sum."""
    dev, ranks, N = "cuda", 2, 8
    moe = _moe(K3ForCausalLM.from_pretrained(hot_model_dir / fmt).to(dev).eval())
    combines = [_moe(load_rank_model(hot_model_dir / fmt, RankLayout(r, ranks), device=dev, replicas=2)).combine_experts
                for r in range(ranks)]

    def place(idx):
        p = place_replicas(torch.bincount(idx.flatten().cpu(), minlength=E), ranks, 2)
        fresh = [c.fresh(p) for c in combines]
        for c, f in zip(combines, fresh):
            c.install(p, torch.cat([combines[e // (E // ranks)].replica_rows([e]) for e in f]) if f else None)

    g = torch.Generator().manual_seed(4)
    z = torch.randn(N, moe.routed_expert_down_proj.out_features, generator=g).to(dev)
    w = torch.rand(N, K, generator=g).to(dev)
    idx = skewed_routing(N, seed=1).to(dev)
    place(skewed_routing(256, seed=2))
    with torch.inference_mode():
        graphs, outs = capture_partials(combines, z, idx, w)
        for seed, hot in ((5, HOT), (6, [4, 5, 8])):
            idx.copy_(skewed_routing(N, seed=seed, hot=hot))
            if hot != HOT:
                place(skewed_routing(256, seed=seed, hot=hot))
            z.normal_()
            for graph in graphs:
                graph.replay()
            torch.testing.assert_close(sum(outs), moe.combine_experts(z, idx, w), rtol=2e-3, atol=2e-4)
    assert any(combines[1].placement.replicas)
