"""The k3-shaped preset (the released widths, 4 layers) and `k3 init`, which writes a fresh model straight into
the released layout with MXFP4 experts, shard by shard (at a reduced width here: the same code path)."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3 import K3Config
from k3.checkpoint.hf import CheckpointError, load_pretrained
from k3.checkpoint.plan import plan_totals
from k3.cli import main
from k3.ops.mx import mxfp4_unpack
from test_checkpoint import read_headers, released_layout
from test_checkpoint_mxfp4 import mxfp4_layout  # SPEC §2 + §4 written out independently

FIXTURE = Path("/work/shared/fixtures/kimi-k3-config.json")
# every field that sizes or shapes a layer; only the layer count and its schedule may differ from the release
WIDTHS = ("hidden_size", "vocab_size", "intermediate_size", "first_k_dense_replace", "moe_layer_freq", "num_experts",
          "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
          "latent_moe_use_norm", "moe_router_activation_func", "moe_renormalize", "routed_scaling_factor",
          "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "num_attention_heads",
          "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "mla_use_nope", "mla_use_output_gate", "rms_norm_eps", "max_position_embeddings", "attn_res_block_size",
          "tie_word_embeddings", "dtype", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id")
LA_WIDTHS = ("num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate")


def released_text_config() -> dict:
    return json.loads(FIXTURE.read_text())["text_config"]


def test_k3_shaped_has_every_released_width():
    cfg, released = K3Config.preset("k3-shaped").to_dict(), released_text_config()
    for name in WIDTHS:
        assert cfg[name] == released[name], name
    for name in LA_WIDTHS:
        assert cfg["linear_attn_config"][name] == released["linear_attn_config"][name], name
    # the fixture has no other field that could drift unchecked
    schedule = {"num_hidden_layers", "linear_attn_config", "model_type", "architectures", "initializer_range",
                "num_nextn_predict_layers", "use_grouped_topk", "num_expert_group", "topk_group", "topk_method"}
    assert set(released) - set(WIDTHS) <= schedule
    for name in schedule - {"num_hidden_layers", "linear_attn_config"}:
        assert cfg[name] == released[name], name


def test_k3_shaped_is_3_kda_then_1_mla_with_a_dense_first_layer():
    cfg = K3Config.preset("k3-shaped")
    assert cfg.num_hidden_layers == 4
    assert [cfg.is_mla(l) for l in range(4)] == [False, False, False, True]
    assert [cfg.is_moe(l) for l in range(4)] == [False, True, True, True]


def test_k3_shaped_checkpoint_size_by_hand():
    """The MXFP4 checkpoint of the preset, summed from SPEC §2's shapes (57.6 GB: more than this machine's disk)."""
    bf, f32 = 2, 4
    D, V, H, d, E, I, L = 7168, 163840, 96, 128, 896, 3072, 3584
    top = 2 * V * D * bf + 3 * D * bf
    per_layer = 6 * D * bf
    kda = (4 * H * d * D + d * D + H * d * d + H * D + D * H * d) * bf + (3 * H * d * 4 + 128 + H * d + d) * f32
    mla = (1536 * D + 1536 + 18432 * 1536 + 576 * D + 512 + 24576 * 512 + H * d * D + D * H * d) * bf
    dense = 3 * 33792 * D * bf
    expert = 3 * (I * L // 2 + I * L // 32)
    moe = (E * D + 2 * L * D + L + 3 * 6144 * D) * bf + E * f32 + E * expert
    want = top + 4 * per_layer + 3 * kda + mla + dense + 3 * moe
    count, nbytes = plan_totals(K3Config.preset("k3-shaped"), "mxfp4")
    assert nbytes == want
    assert count == 5 + 4 * 6 + 3 * 14 + 8 + 3 + 3 * (8 + 6 * E)
    assert round(nbytes / 1e9, 1) == 57.6


def reduced() -> K3Config:
    """k3-shaped's layer plan at small widths (expert in-widths multiples of 32 for MXFP4)."""
    return K3Config.preset("k3-shaped").replace(
        hidden_size=64, vocab_size=512, intermediate_size=96, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=64, routed_expert_hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, linear_attn_config={"num_heads": 2, "head_dim": 16})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("init")
    reduced().save(base / "config.json")
    out = base / "model"
    assert main(["init", "--config", str(base / "config.json"), "--out", str(out), "--shard-size", "40K",
                 "--seed", "3"]) == 0
    return out


def test_init_writes_the_released_layout_with_mxfp4_experts(written):
    assert {k.removeprefix("language_model."): v for k, v in read_headers(written).items()} == \
        {k.removeprefix("language_model."): v for k, v in mxfp4_layout(reduced()).items()}
    assert len(list(written.glob("*.safetensors"))) > 3  # really sharded
    index = json.loads((written / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_headers(written))
    q = json.loads((written / "config.json").read_text())["text_config"]["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized"


def test_init_output_loads_packed_and_has_the_models_init(written):
    model = load_pretrained(written, packed_experts=True)
    cfg = reduced()
    experts = model.model.layers[1].block_sparse_moe.experts
    assert experts.w1_packed.dtype == torch.uint8 and experts.w1_packed.shape == (8, 64, 16)
    # what was loaded is the file's bytes
    with safe_open(str(next(f for f in written.glob("*.safetensors")
                             if "language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed"
                             in safe_open(str(f), "pt").keys())), "pt") as h:
        assert torch.equal(h.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed"),
                           experts.w2_packed[5])
    # the model's init rule: N(0, 0.02) matrices (experts too, before MXFP4), unit norms, zero AttnRes queries
    w = torch.cat([mxfp4_unpack(experts.w1_packed[e], experts.w1_scale[e]).flatten() for e in range(8)])
    assert abs(w.std().item() - cfg.initializer_range) < 0.003
    assert abs(model.lm_head.weight.float().std().item() - cfg.initializer_range) < 0.002
    assert torch.all(model.model.layers[2].input_layernorm.weight == 1)
    assert torch.all(model.model.layers[2].self_attention_res_proj.weight == 0)
    kda = model.model.layers[0].self_attn
    assert torch.all(kda.A_log == 0) and kda.dt_bias.dtype == torch.float32
    rate = torch.sigmoid(kda.dt_bias) * 5  # SPEC §3.2's gate at init: decay rates spread over (0.01, 1)
    assert rate.min() > 0.0099 and rate.max() < 1.0001 and rate.std() > 0.1
    logits = model(torch.randint(0, 512, (1, 9))).logits
    assert torch.isfinite(logits).all()


def test_init_is_the_same_model_at_any_shard_size(written, tmp_path):
    out = tmp_path / "one_shard"
    assert main(["init", "--config", str(written / "config.json"), "--out", str(out), "--seed", "3"]) == 0
    a, b = read_all(written), read_all(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # one tensor a shard, three workers: every MXFP4 pair's halves are made apart, in any order
    threads = tmp_path / "three_workers"
    assert main(["init", "--config", str(written / "config.json"), "--out", str(threads), "--seed", "3",
                 "--shard-size", "1", "--workers", "3"]) == 0
    assert len(list(threads.glob("*.safetensors"))) == len(a)
    c = read_all(threads)
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    other = tmp_path / "other_seed"
    assert main(["init", "--config", str(written / "config.json"), "--out", str(other), "--seed", "4"]) == 0
    assert not torch.equal(read_all(other)["language_model.lm_head.weight"], a["language_model.lm_head.weight"])


def read_all(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def test_init_refuses_a_used_directory_and_too_few_experts(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "keep.txt").read_text() == "mine"
    assert main(["init", "--preset", "k3-shaped", "--num-experts", "8", "--out", str(tmp_path / "x")]) == 2
    assert "--num-experts 8 is below the top-k of 16" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_init_failure_leaves_nothing(tmp_path, monkeypatch):
    import k3.checkpoint.random_init as ri
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, path, metadata=metadata)

    real = ri.save_file
    monkeypatch.setattr(ri, "save_file", failing_save)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ri.write_random_checkpoint(K3Config.preset("tiny"), tmp_path / "out", max_shard_bytes=100_000)
    assert list(tmp_path.iterdir()) == []


def test_init_with_bf16_experts_is_the_released_unquantized_layout(tmp_path):
    reduced().save(tmp_path / "config.json")
    out = tmp_path / "bf16"
    assert main(["init", "--config", str(tmp_path / "config.json"), "--experts-format", "bf16", "--out", str(out)]) == 0
    assert read_headers(out) == released_layout(reduced())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())["text_config"]
    model = load_pretrained(out)
    assert model.model.layers[3].block_sparse_moe.experts.w2.shape == (8, 32, 64)
