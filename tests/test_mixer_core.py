"""The pieces behind one forward per mixer: the K3_* switches (k3.envs), the KDA core's backend selector,
fused input projections, and decode-time MoE over the selected experts, each against its plain reference."""
import copy
import logging

import pytest
import torch

from k3 import envs
from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import LatentMoE, route
from k3.ops import kda_core as core_mod
from k3.ops.fused_linear import FusedLinears, fuse_projections
from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent
from k3.ops.moe_decode import selected_experts_situ_mlp, selected_experts_situ_mlp_reference, use_selected_experts


def test_envs_parse_each_switch():
    s = envs.parse({"K3_NO_FLA": "1", "K3_NO_TRITON": "_conv_triton, _norm_triton", "K3_TRITON": "all",
                    "K3_REQUIRE_FLA": "1", "K3_COMMIT": "abc123"})
    assert s.no_fla and s.require_fla and s.commit == "abc123"
    assert s.triton_off("_conv_triton") and s.triton_off("_norm_triton") and not s.triton_off("_situ_triton")
    assert s.triton_opted_in("_mla_decode_triton")
    d = envs.parse({"K3_NO_FLA": "0"})
    assert not d.no_fla and not d.triton_off("_conv_triton") and not d.triton_opted_in("_mla_decode_triton")
    assert envs.parse({"K3_NO_TRITON": "1"}).triton_off("anything")


def test_envs_read_once_and_override_is_scoped(monkeypatch):
    before = envs.current()
    monkeypatch.setenv("K3_NO_FLA", "1")  # flipping the environment after import changes nothing
    assert envs.current() == before
    with envs.override(no_fla=True, no_triton="_conv_triton"):
        assert envs.current().no_fla and envs.current().triton_off("_conv_triton")
    assert envs.current() == before
    with pytest.raises(ValueError, match="no_such_switch"):
        with envs.override(no_such_switch=True):
            pass


def _features(B, T, H, K, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(B, T, H, K), r(B, T, H, K), r(B, T, H, K), r(B, T, H, K), r(B, T, H), r(H) * 0.5, r(H * K)


def test_kda_core_reference_is_the_composition_of_the_references():
    q, k, v, f, b, A_log, dt_bias = _features(2, 9, 3, 8, seed=1)
    h0 = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    g = kda_gate(f, A_log, dt_bias, -5.0)
    want_o, want_s = kda_recurrent(l2(q), l2(k), v, g, torch.sigmoid(b), initial_state=h0, output_final_state=True)
    for recurrent in (False, True):
        o, s = core_mod.kda_core(q, k, v, f, b, A_log, dt_bias, -5.0, initial_state=h0, output_final_state=True,
                                 recurrent=recurrent)
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s, want_s, rtol=1e-10, atol=1e-10)
    ref_chunk, _ = kda_chunk(l2(q), l2(k), v, g, torch.sigmoid(b), initial_state=h0)
    torch.testing.assert_close(ref_chunk, want_o, rtol=1e-10, atol=1e-10)


def test_backend_selector_defaults_overrides_and_logs_once(caplog):
    q = torch.zeros(1, 2, 3, 8)
    assert core_mod.select_backend(q) == "reference"  # CPU tensors never take fla
    with core_mod.force_backend("fla"):
        assert core_mod.select_backend(q) == "fla"
    assert core_mod.select_backend(q) == "reference"
    with pytest.raises(ValueError, match="'triton'"):
        with core_mod.force_backend("triton"):
            pass
    with pytest.raises(ValueError, match="'nope'"):
        core_mod.kda_core(*_features(1, 2, 3, 8, 0), -5.0, backend="nope")
    core_mod._logged.clear()
    with caplog.at_level(logging.INFO, logger="k3.ops.kda_core"):
        for _ in range(3):
            core_mod.select_backend(q)
    assert [r.getMessage() for r in caplog.records] == ["KDA core on cpu float32: reference"]


def test_fused_linears_equal_the_separate_projections_and_follow_weight_changes():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(16, n, bias=False).double() for n in (8, 3, 6)]
    fused = FusedLinears(*lins)
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        assert fused.weight is None  # off until a decode driver switches it on
        fused.refresh()
        got = fused(x)
        for a, lin in zip(got, lins):
            torch.testing.assert_close(a, lin(x), rtol=1e-12, atol=1e-12)
        # 17 rows padded to 24: the output's rows start 16-byte aligned at 16 bits (cuBLAS's Hopper GEMMs)
        assert fused.weight.shape == (24, 16) and all(a.stride(0) == 24 for a in got) and len(got) == 3
        storage = fused.weight.data_ptr()
        lins[1].weight.mul_(-3.0)  # an in-place update (an optimizer step, a load): refreshed, same storage
        torch.testing.assert_close(fused(x)[1], lins[1](x), rtol=1e-12, atol=1e-12)
        assert fused.weight.data_ptr() == storage
        lins[2].weight.data.add_(1.0)  # through .data: no version bump, so only a forced refresh sees it
        fuse_model = torch.nn.Module()
        fuse_model.fused = fused
        fuse_projections(fuse_model)
        torch.testing.assert_close(fused(x)[2], lins[2](x), rtol=1e-12, atol=1e-12)
    # with gradients needed the separate projections run, and every weight gets its gradient
    sum(t.sum() for t in fused(x)).backward()
    assert all(lin.weight.grad is not None for lin in lins)
    with pytest.raises(ValueError, match="bias-free"):
        FusedLinears(torch.nn.Linear(4, 4))


def test_fused_projection_names_stay_the_released_ones():
    model = K3ForCausalLM(K3Config.preset("tiny"))
    names = set(model.state_dict())
    assert not any("in_proj" in n for n in names)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.layers.1.self_attn.g_proj.weight" in names


def _experts(E=16, k=2, L=12, I=10, N=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return r(N, L), idx, torch.rand(N, k, generator=g, dtype=dtype), r(E, I, L), r(E, I, L), r(E, L, I)


def test_selected_experts_equal_a_per_token_loop():
    z, idx, w, w1, w3, w2 = _experts()
    from k3.ops.situ import situ_glu
    want = torch.stack([sum(w[n, j] * w2[e] @ situ_glu(w1[e] @ z[n], w3[e] @ z[n])
                            for j, e in enumerate(idx[n].tolist())) for n in range(z.shape[0])])
    torch.testing.assert_close(selected_experts_situ_mlp_reference(z, idx, w, w1, w3, w2), want)
    torch.testing.assert_close(selected_experts_situ_mlp(z, idx, w, w1, w3, w2), want)


def test_selected_experts_path_only_for_few_slots_at_inference():
    assert use_selected_experts(1, 8, 64, needs_grad=False)
    assert use_selected_experts(2, 8, 64, needs_grad=False)
    assert not use_selected_experts(3, 8, 64, needs_grad=False)  # 24 slots read most of 64 experts
    assert not use_selected_experts(1, 8, 64, needs_grad=True)
    assert not use_selected_experts(0, 8, 64, needs_grad=False)


def test_moe_decode_path_equals_the_sorted_grouped_path():
    cfg = K3Config.preset("tiny")  # 16 experts, top 4: one token (4 slots) takes the decode path
    torch.manual_seed(3)
    moe = LatentMoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.e_score_correction_bias.normal_()
    x = torch.randn(1, 1, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        fast = moe(x)
        idx, w = route(moe.router_scores(x[0]), moe.gate.e_score_correction_bias, moe.top_k, moe.renormalize,
                       moe.scale)
        assert use_selected_experts(1, moe.top_k, moe.num_experts, needs_grad=False)
    slow = moe(x)  # gradients enabled: the training path (sort, grouped GEMMs), separate projections
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-10, atol=1e-10)


def test_model_inference_paths_equal_the_training_paths():
    """Fused projections and decode-time experts (no grad) against the separate ones (grad), float64, decode."""
    cfg = K3Config.preset("tiny")
    torch.manual_seed(4)
    model = K3ForCausalLM(cfg).double()
    fuse_projections(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    c1, c2 = model.new_cache(), model.new_cache()
    with torch.no_grad():
        a = [model(ids[:, :8], cache=c1).logits] + [model(ids[:, t:t + 1], cache=c1).logits for t in range(8, 12)]
    b = [model(ids[:, :8], cache=c2).logits] + [model(ids[:, t:t + 1], cache=c2).logits for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(a, 1), torch.cat(b, 1).detach(), rtol=1e-9, atol=1e-9)
    assert model.model.layers[1].self_attn.in_proj.weight is not None  # the fused path did run
    twin = copy.deepcopy(model)  # the fused caches follow the copy's own weights
    with torch.no_grad():
        twin.model.layers[1].self_attn.q_proj.weight.zero_()
        assert not torch.allclose(twin(ids).logits, model(ids).logits)


def test_state_in_place_writes_over_the_initial_state():
    q, k, v, f, b, A_log, dt_bias = _features(3, 1, 2, 8, seed=5, dtype=torch.float32)
    h0 = torch.randn(3, 2, 8, 8)
    want_o, want_s = core_mod.kda_core(q, k, v, f, b, A_log, dt_bias, -5.0, initial_state=h0.clone(),
                                       output_final_state=True, recurrent=True)
    buf = h0.clone()
    o, s = core_mod.kda_core(q, k, v, f, b, A_log, dt_bias, -5.0, initial_state=buf, recurrent=True,
                             state_in_place=True)
    assert s is buf and not torch.equal(buf, h0)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(buf, want_s)
    with pytest.raises(ValueError, match="initial_state"):
        core_mod.kda_core(q, k, v, f, b, A_log, dt_bias, -5.0, recurrent=True, state_in_place=True)


def test_static_cache_decode_equals_growing_cache_decode():
    """The StaticCache decode (state written in place) gives the growing K3Cache's logits and states."""
    cfg = K3Config.preset("tiny")
    torch.manual_seed(6)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    grow, static = model.new_cache(), model.new_cache(2, 16)
    with torch.no_grad():
        model(ids[:, :6], cache=grow)
        model(ids[:, :6], cache=static)
        for t in range(6, 10):
            a = model(ids[:, t:t + 1], cache=grow).logits
            b = model(ids[:, t:t + 1], cache=static).logits
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for l in range(cfg.num_hidden_layers):
        if not cfg.is_mla(l):
            torch.testing.assert_close(grow.layers[l].state, static.layers[l].state, rtol=1e-5, atol=1e-5)
