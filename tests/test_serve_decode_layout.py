"""Serving with packed MXFP4 experts in the GPU kernels' decode layout (k3.ops.mxfp4_layout, put in place once at
load by the engine: `EngineConfig.decode_layout`, on by default on CUDA), and expert-parallel steps that compute
only the slots a rank holds (k3.serve.expert_shard `held_slots`, the masked path CUDA graphs capture).

On the CPU the layout is forced on: it is a bit permutation and the reference reads either layout exactly, so a
served model in the decode layout must give the released layout's tokens and logprobs: on one process, and on
two gloo ranks with replicas re-placed mid-run (replica rows cross as raw bytes with a layout tag); a row in the
other layout is converted on arrival, an unknown tag or a scale past the receiver's decode bias is refused; a
served model still saves the released bytes. The masked path computes each held slot once and no other."""
import pytest
import torch

import k3.ops.mx_experts as mx_experts
from k3 import K3ForCausalLM
from k3.checkpoint.sharded import RankLayout
from k3.data import Tokenizer
from k3.ops.mx_experts import in_decode_layout, use_decode_layout_, wants_decode_layout
from k3.ops.mxfp4_layout import to_decode_layout
from k3.serve import EngineConfig, LLMEngine
from k3.serve.expert_balance import place_replicas, slot_holders
from k3.serve.expert_shard import LAYOUT_TAG, load_rank_model
from parallel_harness import launch
from serve_distributed_job import ENGINE, assert_same_serving, engine_config, serve_or_follow, workload
from test_serve_expert_balance import E, _moe, capture_partials, hot_model_dir, skewed_routing  # noqa: F401 (a fixture)

RANKS = 2


def _moes(model):
    from k3.model.moe import LatentMoE
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def test_the_engine_puts_packed_experts_in_the_decode_layout_and_saves_the_released_one(hot_model_dir, tmp_path):
    """One process: the forced decode layout serves the released layout's tokens and logprobs exactly (the CPU's
    default leaves the bytes alone); saving the served model writes the checkpoint's bytes."""
    from safetensors.torch import load_file

    src = hot_model_dir / "mxfp4"
    assert not wants_decode_layout("cpu") and wants_decode_layout("cpu", True)
    assert not wants_decode_layout("cuda", False)
    plain = LLMEngine(K3ForCausalLM.from_pretrained(src, packed_experts=True).eval(), Tokenizer.from_file(),
                      engine_config())
    assert all(m.experts.packed and not in_decode_layout(m.experts) for m in _moes(plain.model))
    want = workload(plain)
    model = K3ForCausalLM.from_pretrained(src, packed_experts=True).eval()
    released = {n: b.clone() for n, b in model.named_buffers() if n.endswith("_packed")}
    engine = LLMEngine(model, Tokenizer.from_file(), EngineConfig(**ENGINE, decode_layout=True))
    assert all(in_decode_layout(m.experts) for m in _moes(model)) and released
    assert all(torch.equal(model.get_buffer(n), to_decode_layout(b)) for n, b in released.items())
    assert_same_serving(workload(engine), want, atol=0)
    model.save_pretrained(tmp_path, dtype=None, experts="mxfp4")
    saved, orig = {}, {}
    for d, into in ((tmp_path, saved), (src, orig)):
        for f in sorted(d.glob("*.safetensors")):
            into.update(load_file(f))
    packed = [k for k in orig if k.endswith("weight_packed")]
    assert packed and saved.keys() == orig.keys()
    assert all(torch.equal(saved[k], orig[k]) for k in orig)


def _combines(model_dir, decode: list[bool], replicas: int = 2, device: str = "cpu"):
    out = []
    for r, d in enumerate(decode):
        model = load_rank_model(model_dir, RankLayout(r, len(decode)), device=device, replicas=replicas)
        if d:
            use_decode_layout_(model)
        out.append(_moe(model).combine_experts)
    return out


def _place(combines, placement, rows=None):
    """Each rank's missing replicas from their home ranks' `replica_rows` (as rebalance's all-to-all moves them)."""
    per = E // len(combines)
    for c in combines:
        fresh = c.fresh(placement)
        got = torch.cat([combines[e // per].replica_rows([e]) for e in fresh]) if fresh else None
        c.install(placement, rows(got) if rows is not None and got is not None else got)


def test_replica_rows_carry_their_layout(hot_model_dir):
    """Rank 0 released, rank 1 in the decode layout: rows cross either way converted to the receiver's layout
    (the partial sums still add to the routed output); a row with an unknown layout tag, or whose scales need a
    larger decode bias than the receiver's kernels were built with, is refused and leaves the placement alone."""
    moe = _moe(K3ForCausalLM.from_pretrained(hot_model_dir / "mxfp4", packed_experts=True).eval())
    g = torch.Generator().manual_seed(3)
    # hot on rank 0, then on rank 1: replicas flow released -> decode, then decode -> released
    idx, idx2 = skewed_routing(32, seed=5), skewed_routing(32, seed=6, hot=[8, 9])
    z = torch.randn(32, moe.routed_expert_down_proj.out_features, generator=g)
    w = torch.rand(32, idx.shape[1], generator=g)
    placement, placement2 = (place_replicas(torch.bincount(i.flatten(), minlength=E), RANKS, 2) for i in (idx, idx2))
    assert placement.replicas[1] and not placement.replicas[0] and placement2.replicas[0]

    hostile = _combines(hot_model_dir / "mxfp4", [False, True])
    before = hostile[1].local.experts.w1_packed.clone()

    def bad_tag(rows):
        rows = rows.clone()
        rows[:, 0] = 7
        return rows

    with pytest.raises(ValueError, match=r"layout tag\(s\) \[7\]"):
        _place(hostile, placement, bad_tag)
    assert hostile[1].placement.replicas == [[], []] and torch.equal(hostile[1].local.experts.w1_packed, before)

    def big_scale(rows):  # the first scale byte of w1 (after the tag and w1's packed bytes) far past 2^1
        rows = rows.clone()
        e = hostile[1].local.experts
        rows[:, 1 + e.w1_packed[0].numel()] = 160
        return rows

    with pytest.raises(ValueError, match="w1 scales need decode bias 32, past this rank's 0"):
        _place(hostile, placement, big_scale)
    with pytest.raises(ValueError, match=r"fetched replica rows must be \[\d+, \d+\]"):
        _place(hostile, placement, lambda rows: rows[:, 1:])  # untagged rows (the old format) are not guessed at

    combines = _combines(hot_model_dir / "mxfp4", [False, True])
    assert combines[0].replica_rows([0])[0, 0] == LAYOUT_TAG["released"]
    assert combines[1].replica_rows([8])[0, 0] == LAYOUT_TAG["decode"]
    for p, i in ((placement, idx), (placement2, idx2)):
        _place(combines, p)
        for r, (c, other) in enumerate(zip(combines, combines[::-1])):
            for e, row in c.slot_of.items():  # a replica's bytes: its home's, in this rank's layout
                home = other.local.experts.w1_packed[e - other.first]
                home = home if in_decode_layout(other.local.experts) else to_decode_layout(home)
                mine = c.local.experts.w1_packed[row]
                assert torch.equal(mine if in_decode_layout(c.local.experts) else to_decode_layout(mine), home)
        assert combines[1 if p is placement else 0].slot_of
        for mode in ("sparse", "masked"):
            for c in combines:
                c.mode = mode
            torch.testing.assert_close(sum(c.partial(z, i, w) for c in combines), moe.combine_experts(z, i, w),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["mxfp4", "f32"])
def test_masked_steps_compute_only_the_held_slots(hot_model_dir, monkeypatch, fmt):
    """The masked path (fixed shapes: what a decode graph captures) computes each slot on the rank that holds it
    and nowhere else: the expert GEMM rows over all ranks add up to N·k (before: N·k on every rank), and the
    partial sums still add to the routed output. Packed (the reference here, as the kernels' tile schedule on
    a GPU): rows through SiTU-GLU, and experts dequantised; float: the rows `torch._grouped_mm`'s offsets cover."""
    packed = fmt == "mxfp4"
    moe = _moe(K3ForCausalLM.from_pretrained(hot_model_dir / fmt, packed_experts=packed).eval())
    g = torch.Generator().manual_seed(4)
    N = 24
    idx = skewed_routing(N, seed=6)
    z = torch.randn(N, moe.routed_expert_down_proj.out_features, generator=g)
    w = torch.rand(N, idx.shape[1], generator=g)
    want = moe.combine_experts(z, idx, w)
    combines = _combines(hot_model_dir / fmt, [packed, packed])
    _place(combines, place_replicas(torch.bincount(idx.flatten(), minlength=E), RANKS, 2))
    rows, unpacked = [], []
    if packed:
        glu, unpack = mx_experts.situ_glu, mx_experts.mxfp4_unpack
        monkeypatch.setattr(mx_experts, "situ_glu", lambda a, *rest: rows.append(a.shape[0]) or glu(a, *rest))
        monkeypatch.setattr(mx_experts, "mxfp4_unpack", lambda p, *rest: unpacked.append(1) or unpack(p, *rest))
    else:
        grouped_mm = torch._grouped_mm

        def spy(a, b, offs=None, **kw):  # the rows a grouped GEMM computes: up to its last offset
            rows.append(int(offs[-1]))
            return grouped_mm(a, b, offs=offs, **kw)
        monkeypatch.setattr(torch, "_grouped_mm", spy)
    parts, computed = [], []
    for r, c in enumerate(combines):
        c.mode = "masked"
        rows.clear(), unpacked.clear()
        held_before = int(c.rows)
        parts.append(c.partial(z, idx, w))
        held = int(c.rows) - held_before  # the slots this rank holds (slot_holders' split)
        computed.append(sum(rows) if packed else rows[0])
        assert computed[-1] == held < idx.numel(), (r, computed, held)
        if packed:  # one dequantisation of 3 matrices per local expert with held slots, none for the others'
            mine = slot_holders(idx, c.cut) == r
            assert len(unpacked) == 3 * len(rows) == 3 * len(set(c.row_of[idx[mine]].tolist()))
        else:  # gate, up, down: each over the held rows only
            assert rows == [held] * 3
    assert sum(computed) == idx.numel()  # every slot once over the two ranks
    torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_held_slots_replay_in_a_cuda_graph_in_the_decode_layout(hot_model_dir):
    """On the GPU, two ranks in the decode layout: their masked partials (the grouped kernels over held slots, the
    others sorted past every tile) captured as CUDA graphs, replayed on new routing and after a re-placement
    (replica rows and tables changed in place), add to the routed sum of the released one-process model."""
    dev, N = "cuda", 8
    moe = _moe(K3ForCausalLM.from_pretrained(hot_model_dir / "mxfp4", device=dev, packed_experts=True).eval())
    combines = _combines(hot_model_dir / "mxfp4", [True, True], device=dev)
    g = torch.Generator().manual_seed(4)
    z = torch.randn(N, moe.routed_expert_down_proj.out_features, generator=g).to(dev)
    w = torch.rand(N, 4, generator=g).to(dev)
    idx = skewed_routing(N, seed=1).to(dev)
    _place(combines, place_replicas(torch.bincount(skewed_routing(256, seed=2).flatten(), minlength=E), RANKS, 2))
    with torch.inference_mode():
        for c in combines:
            c.mode = "masked"
        graphs, outs = capture_partials(combines, z, idx, w)
        for seed, hot in ((5, [0, 1]), (6, [4, 5, 8])):
            idx.copy_(skewed_routing(N, seed=seed, hot=hot))
            if hot != [0, 1]:
                load = torch.bincount(skewed_routing(256, seed=seed, hot=hot).flatten(), minlength=E)
                _place(combines, place_replicas(load, RANKS, 2))
            z.normal_()
            for graph in graphs:
                graph.replay()
            torch.testing.assert_close(sum(outs), moe.combine_experts(z, idx, w), rtol=2e-3, atol=2e-4)


def test_selected_reference_skips_negative_ids():
    """The selected-experts reference's contract for a slot held elsewhere (id < 0): it adds nothing."""
    from k3.ops.moe_decode import selected_experts_situ_mlp_reference as ref

    g = torch.Generator().manual_seed(9)
    w1, w3, w2 = (torch.randn(3, *s, generator=g, dtype=torch.float64) for s in ((8, 16), (8, 16), (16, 8)))
    z = torch.randn(2, 16, generator=g, dtype=torch.float64)
    wt = torch.rand(2, 2, generator=g, dtype=torch.float64)
    idx = torch.tensor([[2, -1], [-1, 1]])
    got = ref(z, idx, wt, w1, w3, w2)
    want = torch.cat([ref(z[:1], idx[:1, :1], wt[:1, :1], w1, w3, w2), ref(z[1:], idx[1:, 1:], wt[1:, 1:], w1, w3, w2)])
    torch.testing.assert_close(got, want)


def bias_job(rank: int, world: int, model_dir: str) -> list:
    """Rank 1's first layer's w1 scales pushed past 2^1: both ranks must take its decode bias."""
    import torch.distributed as dist

    model = load_rank_model(model_dir, RankLayout(rank, world))
    if rank == 1:
        _moe(model).experts.w1_scale[0, 0, 0] = 135
    use_decode_layout_(model, dist.group.WORLD)
    return [m.experts.decode_bias for m in _moes(model)]


def test_decode_bias_is_the_groups_largest(hot_model_dir):
    got = launch(bias_job, RANKS, str(hot_model_dir / "mxfp4"))
    assert got[0] == got[1] and got[0][0] == {"w1": 7, "w2": 0, "w3": 0} and got[0][1]["w1"] == 0


def decode_layout_job(rank: int, world: int, model_dir: str) -> list:
    """The serving workload on `world` ranks in the decode layout, replicas re-placed every 4 steps; once with
    the sparse partial sums, once with the masked (graph) path."""
    from k3.serve.distributed import ServeLayout, build_rank_engine

    out = []
    for mode in ("sparse", "masked"):
        engine = build_rank_engine(model_dir, ServeLayout(world, world, 1, replicas=2, rebalance_steps=4),
                                   EngineConfig(**ENGINE, decode_layout=True))
        combines = engine.balancer.combines
        for c in combines:
            c.mode = mode
        got = serve_or_follow(engine, rank)
        out.append({"got": got, "placements": engine.balancer.placements,
                    "decode": all(in_decode_layout(c.local.experts) for c in combines),
                    "fetched": sum(c.fetched for c in combines), "rows": sum(int(c.rows) for c in combines),
                    "seen": int(sum(c.seen.sum() for c in combines))})
    return out


def test_two_ranks_in_the_decode_layout_with_rebalanced_replicas_equal_released_one_process(hot_model_dir):
    results = launch(decode_layout_job, RANKS, str(hot_model_dir / "mxfp4"))
    single = workload(LLMEngine(K3ForCausalLM.from_pretrained(hot_model_dir / "mxfp4", packed_experts=True).eval(),
                                Tokenizer.from_file(), engine_config()))
    for i, mode in enumerate(("sparse", "masked")):
        r0, r1 = results[0][i], results[1][i]
        assert r0["decode"] and r1["decode"], mode
        assert r0["placements"] == r1["placements"] > 3 and r0["fetched"] + r1["fetched"] > 0, mode
        assert r0["rows"] + r1["rows"] == r0["seen"], mode  # every slot computed once
        assert_same_serving(r0["got"], single)
