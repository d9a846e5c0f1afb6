"""MoonEP planner properties on random and adversarial routings: every rank processes exactly its share of
slots (S×K when ranks route S tokens each), at most E/R redundant experts per rank, replicas from at most one
other rank, and the segments cover every slot exactly once; the plain plan sends every slot home. The plan
built with tensor ops (the one EP runs on the device) equals the step-by-step host construction, and its
per-source send and receive counts equal a slot-by-slot walk of the axis."""
import pytest
import torch

from k3.parallel.planner import balanced_plan, plain_plan, plan_balanced, plan_balanced_reference, plan_plain


def routing_load(kind: str, R: int, per: int, S: int, K: int, seed: int) -> torch.Tensor:
    """Global expert loads of R ranks × S tokens, top-K, E = R·per experts."""
    E = R * per
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R * S)])
    elif kind == "one-expert":  # top-1 and every token to one expert
        idx = torch.full((R * S, 1), int(torch.randint(0, E, (1,), generator=g)))
    elif kind == "one-rank":  # every token to the same K ≤ per experts, homed on one rank
        K = min(K, per)
        first = int(torch.randint(0, R, (1,), generator=g)) * per
        idx = (first + torch.arange(K)).expand(R * S, K)
    else:  # skewed: Zipf-like scores
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        idx = torch.multinomial(w[torch.randperm(E, generator=g)].expand(R * S, E), K, generator=g)
    return torch.bincount(idx.flatten(), minlength=E)


def check_plan(plan, load, R, per):
    N = int(load.sum())
    processed = plan.processed()
    assert sum(processed) == N
    assert processed == [N // R + (r < N % R) for r in range(R)]
    # segments tile [0, N) and send every slot to one rank
    pos = torch.arange(N)
    ranks = plan.slot_ranks(pos)
    assert torch.equal(torch.bincount(ranks, minlength=R), torch.tensor(processed))
    expert_of = torch.repeat_interleave(torch.arange(R * per), load)
    for r in range(R):
        assert len(plan.replicas[r]) <= per  # E/R redundant experts at most
        mine = set(expert_of[ranks == r].tolist())
        foreign = {e for e in mine if e // per != r}
        assert foreign == set(plan.replicas[r])  # replicas are exactly the foreign experts it processes
        assert {e // per for e in foreign} <= ({plan.donor[r]} if plan.donor[r] is not None else set())


@pytest.mark.parametrize("kind", ["random", "one-expert", "one-rank", "zipf"])
@pytest.mark.parametrize("R,per", [(2, 8), (4, 4), (8, 2), (3, 5)])
def test_balanced_plan_properties(kind, R, per):
    for seed in range(20):
        K = 1 if kind == "one-expert" else min(4, R * per - 1)
        S = 1 + seed * 3
        load = routing_load(kind, R, per, S, K, seed)
        plan = plan_balanced(load, R)
        check_plan(plan, load, R, per)
        K_used = int(load.sum()) // (R * S)
        assert plan.processed() == [S * K_used] * R  # exactly S×K whatever the skew


def test_adversarial_plan_replicates_the_hot_expert_everywhere():
    load = torch.zeros(16, dtype=torch.long)
    load[5] = 4 * 10  # 4 ranks × 10 tokens, top-1, all to expert 5 (home rank 1)
    plan = plan_balanced(load, 4)
    assert plan.processed() == [10] * 4
    assert plan.replicas == [[5], [], [5], [5]] and plan.donor == [1, None, 1, 1]


def test_random_small_cases_exhaustively():
    g = torch.Generator().manual_seed(7)
    for trial in range(300):
        R = int(torch.randint(1, 7, (1,), generator=g))
        per = int(torch.randint(1, 4, (1,), generator=g))
        load = torch.randint(0, 6, (R * per,), generator=g) * (torch.rand(R * per, generator=g) < 0.5)
        check_plan(plan_balanced(load, R), load, R, per)


def test_plain_plan_sends_every_slot_home():
    load = routing_load("random", 4, 4, 9, 3, 0)
    plan = plan_plain(load, 4)
    ranks = plan.slot_ranks(torch.arange(int(load.sum())))
    assert torch.equal(ranks, torch.repeat_interleave(torch.arange(16), load) // 4)
    assert not plan.has_replicas


@pytest.mark.parametrize("load,R,match", [(torch.ones(10, dtype=torch.long), 4, "divide the number of experts"),
                                          (torch.ones(8), 2, "integer tensor"),
                                          (-torch.ones(8, dtype=torch.long), 2, "non-negative"),
                                          (torch.ones(8, dtype=torch.long), 0, "num_ranks")])
def test_planner_rejects_bad_input(load, R, match):
    with pytest.raises(ValueError, match=match):
        plan_balanced(load, R)


def assert_same_plan(got, want):
    assert torch.equal(got.seg_start, want.seg_start) and torch.equal(got.seg_rank, want.seg_rank)
    assert got.donor == want.donor and got.replicas == want.replicas


@pytest.mark.parametrize("kind", ["random", "one-expert", "one-rank", "zipf"])
@pytest.mark.parametrize("R,per", [(1, 4), (2, 8), (4, 4), (8, 2), (3, 5), (16, 3)])
def test_device_plan_equals_host_construction(kind, R, per):
    for seed in range(40):
        K = 1 if kind == "one-expert" else max(1, min(4, R * per - 1))
        load = routing_load(kind, R, per, 1 + seed * 3, K, seed)
        assert_same_plan(plan_balanced(load, R), plan_balanced_reference(load, R))


def test_device_plan_equals_host_construction_on_sparse_random_loads():
    g = torch.Generator().manual_seed(11)
    relays = 0
    for trial in range(1500):
        R = int(torch.randint(1, 9, (1,), generator=g))
        per = int(torch.randint(1, 4, (1,), generator=g))
        load = torch.randint(0, 9, (R * per,), generator=g) * (torch.rand(R * per, generator=g) < 0.5)
        want = plan_balanced_reference(load, R)
        assert_same_plan(plan_balanced(load, R), want)
        relays += any(d is not None and want.donor[d] is not None for d in want.donor)
    assert relays > 10  # the relay branch (a donor replicating another donor) was exercised


def walk_axis(load_by_source: torch.Tensor, plan) -> torch.Tensor:
    """[R_src, R_dst, E] slot counts found by laying out every slot: expert by expert, source by source."""
    R, E = load_by_source.shape
    out = torch.zeros(R, R, E, dtype=torch.long)
    pos = 0
    for e in range(E):
        for s in range(R):
            for _ in range(int(load_by_source[s, e])):
                out[s, int(plan.slot_ranks(torch.tensor([pos]))), e] += 1
                pos += 1
    return out


@pytest.mark.parametrize("R,per", [(2, 4), (3, 2), (4, 3)])
def test_sent_and_received_equal_a_walk_of_the_slot_axis(R, per):
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        skew = torch.rand(R * per, generator=g) ** 4 * 8  # a few hot experts
        counts = torch.poisson(skew.expand(R, -1), generator=g).long()
        for make in (balanced_plan, plain_plan):
            plan = make(counts.sum(0), R)
            walked = walk_axis(counts, plan)
            for r in range(R):
                assert torch.equal(plan.sent(counts, r), walked[r].sum(1))
                assert torch.equal(plan.received(counts, r), walked[:, r])
