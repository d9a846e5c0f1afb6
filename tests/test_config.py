"""K3Config: the released config round-trips, presets match it, the tiny preset has every K3 component,
and invalid configs raise a ConfigError that names the field."""
import json
import re
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
    from k3.model import attn_res
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
    real_mix = attn_res.attn_res_mix  # what every mix of the decoder calls (through attn_res_mix_norm)
    monkeypatch.setattr(attn_res, "attn_res_mix", lambda src, *rest: seen.append(len(src)) or real_mix(src, *rest))
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


# ---- config.json as a user writes it (issue 17: every field read is honoured or rejected) -----------------------
def write_config(tmp_path, top: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(top))
    return tmp_path


def released_with(released, **text_changes) -> dict:
    top = json.loads(json.dumps(released))
    top["text_config"].update(text_changes)
    return top


def test_linear_attn_config_not_an_object_names_the_field(tmp_path, released):
    write_config(tmp_path, released_with(released, linear_attn_config="oops"))
    with pytest.raises(ConfigError, match=r"linear_attn_config='oops'.*must be an object with num_heads"):
        K3Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_experts", "eos_token_id", "dtype",
                                   "linear_attn_config.num_heads", "linear_attn_config.kda_layers"])
def test_missing_field_is_named_not_taken_from_the_released_model(tmp_path, released, field):
    top = json.loads(json.dumps(released))
    parent, _, name = ("text_config." + field).rpartition(".")
    container = top["text_config"] if parent == "text_config" else top["text_config"]["linear_attn_config"]
    del container[name]
    top.pop(name, None)  # the released top level repeats eos_token_id and dtype
    write_config(tmp_path, top)
    with pytest.raises(ConfigError, match=rf"missing field text_config\.{re.escape(field)}\b"):
        K3Config.from_pretrained(tmp_path)


def test_missing_fields_of_a_bare_text_config_are_all_named(tmp_path, released):
    text = dict(released["text_config"])
    del text["hidden_size"], text["num_hidden_layers"]
    write_config(tmp_path, text)
    with pytest.raises(ConfigError, match="missing fields hidden_size, num_hidden_layers"):
        K3Config.from_pretrained(tmp_path)


def test_optional_fields_may_be_left_out(tmp_path, released):
    optional = ("model_type", "architectures", "quantization_config", "initializer_range", "tie_word_embeddings")
    text = {k: v for k, v in released["text_config"].items() if k not in optional}
    cfg = K3Config.from_pretrained(write_config(tmp_path, text))
    assert cfg.quantization_config is None and cfg.tie_word_embeddings is False and cfg.hidden_size == 7168


BAD_FIELDS = [
    (dict(mla_use_nope="true"), "mla_use_nope", "JSON boolean"),
    (dict(moe_renormalize="false"), "moe_renormalize", "JSON boolean"),
    (dict(latent_moe_use_norm=1), "latent_moe_use_norm", "JSON boolean"),
    (dict(linear_attn_config={"use_full_rank_gate": "yes"}), "use_full_rank_gate", "JSON boolean"),
    (dict(dtype="bf16"), "dtype", "bfloat16, float16, float32, float64"),
    (dict(dtype="float8_e4m3fn"), "dtype", "bfloat16"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings", "lm_head separate"),
    (dict(mla_use_output_gate=False), "mla_use_output_gate", "only true"),
    (dict(max_position_embeddings=0), "max_position_embeddings", "positive integer"),
    (dict(max_position_embeddings="1M"), "max_position_embeddings", "positive integer"),
    (dict(eos_token_id=163840), "eos_token_id", r"\[0, vocab_size=163840\)"),
    (dict(eos_token_id=[163586, -1]), "eos_token_id", "token id"),
    (dict(bos_token_id="<s>"), "bos_token_id", "token id"),
    (dict(model_type="llama"), "model_type", "kimi_linear"),
    (dict(initializer_range=-1), "initializer_range", "> 0"),
    (dict(quantization_config={"quant_method": "fp8", "format": "float-quantized"}), "quantization_config",
     "mxfp4-pack-quantized"),
    # JSON ints have no bound; torch's sizes are int64 (these were a TypeError / RuntimeError from the build)
    (dict(hidden_size=10**30), "hidden_size", r"positive integer \(below 2\^31\)"),
    (dict(num_experts=2**30, moe_intermediate_size=2**30), "routed experts' stack", "more than 2\\^40"),
    (dict(num_attention_heads=2**20, num_key_value_heads=2**20, q_lora_rank=2**20), "q_b_proj", "more than 2\\^40"),
]


@pytest.mark.parametrize("changes,field,allowed", BAD_FIELDS,
                         ids=[f"{f}={list(c.values())[0]!r}" for c, f, _ in BAD_FIELDS])
def test_bad_field_in_config_json_names_field_and_choices(tmp_path, released, changes, field, allowed):
    top = json.loads(json.dumps(released))
    for k, v in changes.items():
        if k == "linear_attn_config":
            top["text_config"][k].update(v)
        else:
            top["text_config"][k] = v
            if k in top:  # keep the top level in step, so that only the bad value is reported
                top[k] = v
    write_config(tmp_path, top)
    with pytest.raises(ConfigError, match=field) as e:
        K3Config.from_pretrained(tmp_path)
    assert re.search(allowed, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_top_level_and_text_config_must_agree(tmp_path, released):
    top = json.loads(json.dumps(released))
    top["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="tie_word_embeddings is True at the top level but False in text_config"):
        K3Config.from_pretrained(write_config(tmp_path, top))


def test_top_level_fills_what_text_config_leaves_out(tmp_path, released):
    top = json.loads(json.dumps(released))
    del top["text_config"]["eos_token_id"]
    top["eos_token_id"] = 7
    assert K3Config.from_pretrained(write_config(tmp_path, top)).eos_token_id == 7


def test_torch_dtype_is_read_as_dtype_and_eos_may_be_a_list(tmp_path, released):
    text = dict(released["text_config"], eos_token_id=[163586, 163585], torch_dtype="float32")
    del text["dtype"]
    cfg = K3Config.from_pretrained(write_config(tmp_path, text))
    assert cfg.dtype == "float32" and cfg.eos_token_id == [163586, 163585]


def test_transformers_top_level_torch_dtype_is_the_dtype(tmp_path, released):
    top = json.loads(json.dumps(released))
    del top["dtype"], top["text_config"]["dtype"]
    top["torch_dtype"] = "float16"
    assert K3Config.from_pretrained(write_config(tmp_path, top)).dtype == "float16"


# ---- the scale-out preset: work for expert and context parallelism to hide communication behind -------------
def test_scale_out_preset_is_k3_shaped():
    cfg = K3Config.preset("scale-out")
    L = cfg.num_hidden_layers
    assert cfg.mla_layer_ids == {l for l in range(L) if (l + 1) % 4 == 0 or l == L - 1}
    assert not cfg.is_moe(0) and all(cfg.is_moe(l) for l in range(1, L))
    assert cfg.routed_expert_hidden_size == cfg.hidden_size // 2 and cfg.num_shared_experts == 2
    assert cfg.num_experts % 4 == 0  # EP = 2 and EP = 4 both divide the experts


def expert_flops_per_exchanged_byte(cfg) -> float:
    """A token-slot's expert GEMMs (w1, w3, w2: 6·L·I FLOPs) per byte its bf16 latent row moves in dispatch and
    combine (2 · 2L B)."""
    L, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    return 6 * L * inter / (2 * 2 * L)


def test_scale_out_experts_outlast_their_all_to_all_on_h200():
    # SPEC §6: about 790 TFLOP/s bf16 matmul against 276 GiB/s NCCL all_to_all_single per rank (512 MiB)
    h200 = 790e12 / (276 * 2**30)
    assert expert_flops_per_exchanged_byte(K3Config.preset("scale-out")) > 2 * h200
    assert expert_flops_per_exchanged_byte(K3Config.preset("small")) < h200  # why small did not pay


def test_scale_out_fits_one_gpu_at_32k_and_needs_two_at_256k():
    from k3.parallel.memory_plan import parse_bytes, plan_memory
    cfg, h200 = K3Config.preset("scale-out"), parse_bytes("141GB")
    assert plan_memory(cfg, 1, h200, seq_len=32768).fits  # the one-GPU baseline runs
    assert plan_memory(cfg, 2, h200, ep=2, seq_len=32768).fits
    assert plan_memory(cfg, 2, h200, cp=2, ep=1, seq_len=32768).fits
    assert not plan_memory(cfg, 1, h200, seq_len=262144).fits
    assert plan_memory(cfg, 2, h200, cp=2, ep=2, seq_len=262144).fits
