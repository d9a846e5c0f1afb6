"""K3Config: the released config round-trips, presets match it, the tiny preset has every K3 component,
and invalid configs raise a ConfigError that names the field."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import k3
from k3 import ConfigError, K3Config

FIXTURE = Path("/work/shared/fixtures/kimi-k3-config.json")



@pytest.fixture(scope="module")
def released() -> dict:
    return json.loads(FIXTURE.read_text())


# ---- round trips ------------------------------------------------------------------------------------------
def test_from_pretrained_file_reads_every_text_config_field(released):
    cfg = K3Config.from_pretrained(FIXTURE)
    text = released["text_config"]
    assert cfg.to_dict() == text  # every field, nothing added, nothing lost
    assert cfg.hidden_size == 7168 and cfg.num_hidden_layers == 93 and cfg.num_experts == 896
    assert cfg.linear_attn_config.gate_lower_bound == -5.0
    assert cfg.quantization_config == text["quantization_config"]


def test_from_pretrained_directory_holding_config_json(tmp_path, released):
    shutil.copy(FIXTURE, tmp_path / "config.json")
    assert K3Config.from_pretrained(tmp_path).to_dict() == released["text_config"]


def test_from_pretrained_bare_text_config(tmp_path, released):
    (tmp_path / "config.json").write_text(json.dumps(released["text_config"]))
    assert K3Config.from_pretrained(tmp_path / "config.json").to_dict() == released["text_config"]


def test_save_then_load_keeps_every_field(tmp_path, released):
    cfg = K3Config.from_pretrained(FIXTURE)
    cfg.save(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert written["model_type"] == "kimi_k3"
    assert written["text_config"] == released["text_config"]
    again = K3Config.from_pretrained(tmp_path)
    assert again == cfg
    assert again.to_dict() == released["text_config"]


def test_unknown_fields_survive_a_round_trip(tmp_path, released):
    text = dict(released["text_config"], some_future_field={"a": [1, 2]})
    text["linear_attn_config"] = dict(text["linear_attn_config"], future_kda_knob=7)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    cfg = K3Config.from_pretrained(tmp_path)
    cfg.save(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["text_config"] == text


def test_kimi_k3_preset_equals_released_text_config(released):
    assert K3Config.preset("kimi-k3").to_dict() == released["text_config"]
    assert K3Config.preset("kimi-k3") == K3Config.from_pretrained(FIXTURE)


def test_released_schedule_is_69_kda_plus_24_mla():
    cfg = K3Config.preset("kimi-k3")
    mla = sorted(cfg.mla_layer_ids)
    assert mla == [l for l in range(93) if (l + 1) % 4 == 0 or l == 92]
    assert len(mla) == 24 and 93 - len(mla) == 69


# ---- the tiny preset has every component ----------------------------------------------------------------
def test_tiny_preset_config_has_every_component():
    cfg = K3Config.preset("tiny")
    L = cfg.num_hidden_layers
    mla = cfg.mla_layer_ids
    # 3:1 KDA:MLA schedule with a terminal MLA layer, both kinds present.
    assert mla == {l for l in range(L) if (l + 1) % 4 == 0 or l == L - 1}
    assert L - 1 in mla and 0 < len(mla) < L
    # Block AttnRes: blocks are appended at l = 0, B, 2B, ...; at least two of them.
    assert sum(l % cfg.attn_res_block_size == 0 for l in range(L)) >= 2
    assert not cfg.is_moe(0) and all(cfg.is_moe(l) for l in range(1, L))
    assert cfg.num_experts >= 16 and cfg.num_experts_per_token == 4 and cfg.num_shared_experts == 2
    assert cfg.routed_expert_hidden_size == cfg.hidden_size // 2


def test_tiny_preset_model_has_every_component(monkeypatch):
    from k3.model import decoder
    from k3.model.kda import KimiDeltaAttention
    from k3.model.mla import MultiHeadLatentAttention
    from k3.model.mlp import SiTUMLP
    from k3.model.moe import LatentMoE

    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    model = k3.K3ForCausalLM(cfg)
    layers = model.model.layers
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    kinds = ["MLA" if isinstance(l.self_attn, MultiHeadLatentAttention) else "KDA" for l in layers]
    assert all(isinstance(l.self_attn, (KimiDeltaAttention, MultiHeadLatentAttention)) for l in layers)
    assert kinds == ["MLA" if (l + 1) % 4 == 0 or l == L - 1 else "KDA" for l in range(L)]
    assert isinstance(layers[0].mlp, SiTUMLP) and not hasattr(layers[0], "block_sparse_moe")
    for layer in layers[1:]:
        moe = layer.block_sparse_moe
        assert isinstance(moe, LatentMoE) and not hasattr(layer, "mlp")
        assert moe.experts.w1.shape[0] >= 16 and moe.top_k == 4
        assert moe.routed_expert_down_proj.weight.shape == (D // 2, D)  # latent = hidden / 2
        assert moe.experts.w1.shape[-1] == D // 2
        # two shared experts fused into one MLP of twice the expert width
        assert moe.shared_experts.gate_proj.weight.shape == (2 * cfg.moe_intermediate_size, D)

    # Count the AttnRes sources the built model really mixes: the output mix sees every stored block + p.
    seen = []
    real_mix = decoder.attn_res_mix
    monkeypatch.setattr(decoder, "attn_res_mix", lambda src, n, p: seen.append(len(src)) or real_mix(src, n, p))
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 5)))
    assert seen[-1] - 1 >= 2  # >= 2 stored blocks (embedding + at least one completed block)
    assert max(seen) == seen[-1]


# ---- invalid configs --------------------------------------------------------------------------------------
INVALID = [
    (dict(num_experts_per_token=17), "num_experts_per_token"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts=0), "num_experts"),
    (dict(hidden_size="big"), "hidden_size"),
    (dict(rms_norm_eps=None), "rms_norm_eps"),
    (dict(activation_situ_beta="4"), "activation_situ_beta"),
    (dict(linear_attn_config=dict(full_attn_layers=[4, 7], kda_layers=[1, 2, 3, 5, 6])), "full_attn_layers"),
    (dict(linear_attn_config=dict(full_attn_layers=[0, 4, 6])), "full_attn_layers"),
    (dict(linear_attn_config=dict(full_attn_layers=[3, 4, 6])), "kda_layers"),  # layer 3 is in both lists
    (dict(linear_attn_config=dict(full_attn_layers=[6])), "kda_layers"),  # layer 4 in neither list
    (dict(linear_attn_config=dict(gate_lower_bound=0.0)), "gate_lower_bound"),
    (dict(linear_attn_config=dict(gate_lower_bound=1.5)), "gate_lower_bound"),
    (dict(linear_attn_config=dict(gate_lower_bound=float("-inf"))), "gate_lower_bound"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
]


@pytest.mark.parametrize("changes,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        K3Config.preset("tiny").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset"):
        K3Config.preset("kimi-k4")


def test_config_error_is_a_value_error():
    # callers that catch ValueError for bad user input also catch config errors
    assert issubclass(ConfigError, ValueError)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        K3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        K3Config.from_pretrained(tmp_path)
