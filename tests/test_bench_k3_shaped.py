"""benchmarks/bench_k3_shaped.py's arithmetic: the bytes a decode step must read equal a count made here from the
model's state dict, the config and a real StaticCache; the expected number of distinct experts a batch touches
matches a simulation of random top-k routing; the model it builds holds packed draws of the init rule."""
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from k3.model.cache import KDAState, MLAState
from k3.ops.mx import mxfp4_unpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_k3_shaped as bench  # noqa: E402


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def built(request):
    cfg = bench.shaped_config(quick=True)
    return cfg, bench.build_packed_model(cfg, torch.device("cpu"), request.param, seed=0)


def simulated_distinct(E: int, k: int, B: int, trials: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per trial when B tokens each take the top-k of random scores (k distinct experts)."""
    chosen = torch.rand(trials, B, E, generator=gen).topk(k, dim=-1).indices.flatten(1)
    hit = torch.zeros(trials, E, dtype=torch.bool).scatter_(1, chosen, True)
    return hit.sum(1).double()


@pytest.mark.parametrize("E,k,B", [(896, 16, 1), (896, 16, 8), (896, 16, 64), (64, 16, 4), (64, 16, 64)])
def test_expected_distinct_experts_matches_random_routing(E, k, B):
    gen = torch.Generator().manual_seed(E * 1000 + B)
    trials = max(50, 20_000 // B)
    d = simulated_distinct(E, k, B, trials, gen)
    expected = bench.expected_distinct_experts(E, k, B)
    # 5 standard errors of the simulated mean (and 0.01 for the exact B = 1 case, where d never varies)
    assert abs(d.mean().item() - expected) <= 5 * d.std().item() / math.sqrt(trials) + 0.01, (d.mean(), expected)


def test_expected_distinct_experts_is_not_the_naive_count():
    """At 64 tokens x top-16 of 896 the naive B·k = 1024 exceeds E: about 612 are read, not 896 or 1024."""
    assert 600 < bench.expected_distinct_experts(896, 16, 64) < 625


@pytest.mark.parametrize("B,ctx", [(1, 40), (8, 64), (64, 17)])
def test_step_bytes_equal_an_independent_count(built, B, ctx):
    cfg, model = built
    sd = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    # routed experts from the config: w1, w3 [E, I, L] and w2 [E, L, I], 4-bit codes + one E8M0 byte per 32
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    E, I, L = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    experts = n_moe * E * 3 * I * L * (1 / 2 + 1 / 32)
    emb = sd["model.embed_tokens.weight"]
    embedding = emb.numel() * emb.element_size()
    touched = bench.expected_distinct_experts(E, cfg.num_experts_per_token, B) / E
    weights = total - experts - embedding + B * emb.shape[1] * emb.element_size() + experts * touched
    # states and latents from a real cache: KDA states and conv tails read and written, MLA latents read
    cache = model.new_cache(B, ctx + 5)
    state = kv = 0
    for st in cache.layers:
        if isinstance(st, KDAState):
            state += 2 * sum(t.numel() * t.element_size() for t in dataclasses.astuple(st))
        else:
            assert isinstance(st, MLAState)
            kv += sum(t[:, :ctx].numel() * t.element_size() for t in (st.latent, st.k_extra))
    parts = bench.step_bytes(model, cfg, B, ctx)
    assert parts["experts"] == pytest.approx(experts * touched, rel=1e-12)
    assert parts["state"] == state and parts["kv"] == kv
    assert parts["total"] == pytest.approx(weights + state + kv, rel=1e-12)


def test_weight_bytes_split_experts_from_the_rest(built):
    cfg, model = built
    wb = bench.weight_bytes(model)
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert wb["experts"] == n_moe * cfg.num_experts * 3 * cfg.moe_intermediate_size * \
        cfg.routed_expert_hidden_size * (1 / 2 + 1 / 32)
    assert wb["total"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_built_model_holds_packed_init_draws(built):
    """Experts packed from Normal(0, initializer_range) draws, dense weights drawn (not to_empty's garbage),
    float32 where the release keeps float32 (A_log, dt_bias), router bias zero, and a finite forward."""
    cfg, model = built
    moe = model.model.layers[1].block_sparse_moe
    assert moe.experts.packed and moe.experts.w1_packed.dtype == torch.uint8
    w = mxfp4_unpack(moe.experts.w2_packed, moe.experts.w2_scale)
    assert abs(w.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range
    assert abs(w.mean().item()) < 1e-3
    assert not torch.equal(moe.experts.w1_packed[0], moe.experts.w1_packed[1])  # each expert its own draw
    emb = model.model.embed_tokens.weight.float()
    assert abs(emb.std().item() - cfg.initializer_range) < 0.05 * cfg.initializer_range
    kda = model.model.layers[1].self_attn
    assert kda.dt_bias.dtype == torch.float32 and kda.A_log.dtype == torch.float32
    assert moe.gate.weight.dtype == model.model.embed_tokens.weight.dtype  # the router is stored like the rest
    assert kda.dt_bias.abs().min() > 0  # drawn by the init rule
    assert torch.all(moe.gate.e_score_correction_bias == 0)
    assert torch.all(model.model.norm.weight == 1)
    with torch.no_grad():
        logits = model(torch.randint(0, cfg.vocab_size, (2, 5))).logits
    assert torch.isfinite(logits).all()


def test_routed_experts_counts_each_layers_distinct_choices(built):
    """One token picks exactly top-k distinct experts per layer; 8 random tokens pick more, at most all E."""
    cfg, model = built
    k, E = cfg.num_experts_per_token, cfg.num_experts
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        one = bench.routed_experts(model, lambda: model(torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)))
        eight = bench.routed_experts(model, lambda: model(torch.randint(0, cfg.vocab_size, (8, 1), generator=gen)))
    assert one == k
    assert k < eight <= E
    assert not any(m._forward_pre_hooks for m in model.modules())  # the hooks are gone afterwards
