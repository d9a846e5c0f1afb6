"""Checkpoints in the released Hugging Face layout: save → load is the identity, the file layout is the
released one (names, shapes, dtypes; SPEC §2), and broken checkpoints are reported clearly."""
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint.convert import verify_checkpoint
from k3.checkpoint.hf import CheckpointError
from k3.checkpoint.sharded import RankLayout, load_rank_shard

INDEX = "model.safetensors.index.json"
# SPEC §2: the only F32 tensors of the released checkpoint
F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")



def small_config() -> K3Config:
    # the tiny preset with expert width != latent width, so that [I, L] and [L, I] are told apart
    return K3Config.preset("tiny").replace(moe_intermediate_size=48)


def make_model(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(small_config())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # make the tensors that start constant distinguishable
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("res_proj.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g))
    return model.eval()


def shard_files(path):
    return sorted(path.glob("*.safetensors"))


def read_headers(path) -> dict:
    """name → (shape, safetensors dtype string) over all shards."""
    out = {}
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                s = h.get_slice(n)
                out[n] = (tuple(s.get_shape()), s.get_dtype())
    return out


def released_layout(cfg: K3Config) -> dict:
    """SPEC §2 written out from the config alone: name → (shape, dtype)."""
    D, V, E = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    la = cfg.linear_attn_config
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    Hm = cfg.num_attention_heads
    I, L = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    bf, f32 = "BF16", "F32"
    t = {"model.embed_tokens.weight": ([V, D], bf), "model.norm.weight": ([D], bf),
         "model.output_attn_res_norm.weight": ([D], bf), "model.output_attn_res_proj.weight": ([1, D], bf),
         "lm_head.weight": ([V, D], bf)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + n + ".weight"] = ([D], bf)
        t[p + "self_attention_res_proj.weight"] = ([1, D], bf)
        t[p + "mlp_res_proj.weight"] = ([1, D], bf)
        a = p + "self_attn."
        if (l + 1) in la.full_attn_layers:
            q_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            t |= {a + "q_a_proj.weight": ([cfg.q_lora_rank, D], bf),
                  a + "q_a_layernorm.weight": ([cfg.q_lora_rank], bf),
                  a + "q_b_proj.weight": ([Hm * q_head, cfg.q_lora_rank], bf),
                  a + "kv_a_proj_with_mqa.weight": ([cfg.kv_lora_rank + cfg.qk_rope_head_dim, D], bf),
                  a + "kv_a_layernorm.weight": ([cfg.kv_lora_rank], bf),
                  a + "kv_b_proj.weight": ([Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank], bf),
                  a + "g_proj.weight": ([Hm * cfg.v_head_dim, D], bf),
                  a + "o_proj.weight": ([D, Hm * cfg.v_head_dim], bf)}
        else:
            for n in ("q", "k", "v"):
                t[a + f"{n}_proj.weight"] = ([H * K, D], bf)
                t[a + f"{n}_conv1d.weight"] = ([H * K, 1, W], f32)
            t |= {a + "f_a_proj.weight": ([K, D], bf), a + "f_b_proj.weight": ([H * K, K], bf),
                  a + "b_proj.weight": ([H, D], bf), a + "g_proj.weight": ([H * K, D], bf),
                  a + "A_log": ([math.ceil(H / 128) * 128], f32), a + "dt_bias": ([H * K], f32),
                  a + "o_norm.weight": ([K], f32), a + "o_proj.weight": ([D, H * K], bf)}
        if l < cfg.first_k_dense_replace:
            Id = cfg.intermediate_size
            t |= {p + "mlp.gate_proj.weight": ([Id, D], bf), p + "mlp.up_proj.weight": ([Id, D], bf),
                  p + "mlp.down_proj.weight": ([D, Id], bf)}
        else:
            m = p + "block_sparse_moe."
            Is = cfg.num_shared_experts * I
            t |= {m + "gate.weight": ([E, D], bf), m + "gate.e_score_correction_bias": ([E], f32),
                  m + "routed_expert_down_proj.weight": ([L, D], bf), m + "routed_expert_norm.weight": ([L], bf),
                  m + "routed_expert_up_proj.weight": ([D, L], bf),
                  m + "shared_experts.gate_proj.weight": ([Is, D], bf),
                  m + "shared_experts.up_proj.weight": ([Is, D], bf),
                  m + "shared_experts.down_proj.weight": ([D, Is], bf)}
            for e in range(E):
                t |= {m + f"experts.{e}.w1.weight": ([I, L], bf), m + f"experts.{e}.w2.weight": ([L, I], bf),
                      m + f"experts.{e}.w3.weight": ([I, L], bf)}
    return {"language_model." + n: (tuple(s), d) for n, (s, d) in t.items()}


def test_released_layout_reference_counts_match_spec():
    # SPEC §2: 497,052 text tensors in the released checkpoint. Counted without listing 250k expert names:
    cfg = K3Config.preset("kimi-k3")
    # each released expert matrix is two tensors (MXFP4 weight_packed + weight_scale), one `.weight` here.
    one_expert = len(released_layout(cfg.replace(num_experts=1, num_experts_per_token=1)))
    n_moe = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
    non_expert = one_expert - n_moe * 3
    assert non_expert + n_moe * cfg.num_experts * 3 * 2 == 497_052
    assert 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size == 33_030_144  # per routed expert


# ---- identity ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def bf16_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(path)
    return path


def test_float32_save_load_is_identity(model, tmp_path):
    model.save_pretrained(tmp_path, dtype=None)
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for n in a:
        assert b[n].dtype == torch.float32, n
        assert torch.equal(a[n], b[n]), n
    assert any(n.endswith("e_score_correction_bias") for n in b)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["dtype"] == "float32"


def test_bf16_save_load_rounds_only_bf16_tensors(model, bf16_dir):
    loaded = K3ForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    a = model.state_dict()
    for n, t in loaded.state_dict().items():
        if n.endswith(F32_SUFFIXES):
            assert t.dtype == torch.float32 and torch.equal(t, a[n]), n  # F32 tensors stay exact
        else:
            assert t.dtype == torch.bfloat16 and torch.equal(t, a[n].bfloat16()), n


# ---- the released layout -----------------------------------------------------------------------------------------
def test_bf16_files_have_the_released_layout(bf16_dir):
    assert read_headers(bf16_dir) == released_layout(small_config())


def test_a_log_is_padded_with_zeros(model, bf16_dir):
    with safe_open(str(shard_files(bf16_dir)[0]), framework="pt") as h:
        a_log = h.get_tensor("language_model.model.layers.0.self_attn.A_log")
    H = model.config.linear_attn_config.num_heads
    assert torch.equal(a_log[:H], model.model.layers[0].self_attn.A_log.detach())
    assert torch.equal(a_log[H:], torch.zeros(128 - H))


def test_per_expert_tensors_are_slices_of_the_stack(model, bf16_dir):
    experts = model.model.layers[2].block_sparse_moe.experts
    with safe_open(str(shard_files(bf16_dir)[0]), framework="pt") as h:
        for e in (0, 5, 15):
            for w in ("w1", "w2", "w3"):
                got = h.get_tensor(f"language_model.model.layers.2.block_sparse_moe.experts.{e}.{w}.weight")
                assert torch.equal(got, getattr(experts, w)[e].detach().bfloat16())


def test_config_json_top_level(bf16_dir):
    cfg = json.loads((bf16_dir / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k3"
    assert cfg["text_config"]["model_type"] == "kimi_linear"
    assert cfg["text_config"]["dtype"] == "bfloat16"
    assert K3Config.from_dict(cfg).replace(dtype="float32") == small_config()


def test_index_is_consistent_with_single_shard(bf16_dir):
    index = json.loads((bf16_dir / INDEX).read_text())
    (only,) = shard_files(bf16_dir)
    assert set(index["weight_map"].values()) == {only.name}
    assert set(index["weight_map"]) == set(read_headers(bf16_dir))


# ---- variations that must still load ----------------------------------------------------------------------------
def test_loads_names_without_prefix(model, bf16_dir, tmp_path):
    for f in bf16_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    for f in shard_files(tmp_path):
        tensors = load_file(str(f))
        save_file({n.removeprefix("language_model."): t for n, t in tensors.items()}, str(f))
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"] = {n.removeprefix("language_model."): f for n, f in index["weight_map"].items()}
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert not any(n.startswith("language_model.") for n in read_headers(tmp_path))
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    original = model.state_dict()
    for n, t in loaded.state_dict().items():
        want = original[n] if n.endswith(F32_SUFFIXES) else original[n].bfloat16().float()
        assert torch.equal(t, want), n


def test_multi_shard_checkpoint(model, tmp_path):
    model.save_pretrained(tmp_path, dtype=None, max_shard_bytes=1 << 20)
    files = shard_files(tmp_path)
    assert len(files) > 3
    assert [f.name for f in files] == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    index = json.loads((tmp_path / INDEX).read_text())
    total, where = 0, {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                t = h.get_tensor(n)
                total += t.numel() * t.element_size()
                where[n] = f.name
    assert index["weight_map"] == where  # every tensor, and the file that really holds it
    assert index["metadata"]["total_size"] == total
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    for n, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[n], t), n



def test_a_save_over_an_earlier_one_leaves_only_its_own_shards(model, tmp_path):
    """Saved in many shards, then again in one into the same directory: the directory holds exactly the shards
    the new index names, so a reader of every `*.safetensors` there (llama.cpp's converter) sees each tensor once,
    with the new save's values."""
    model.save_pretrained(tmp_path, dtype=None, max_shard_bytes=1 << 20)
    assert len(shard_files(tmp_path)) > 3
    (tmp_path / "notes.safetensors.txt").write_text("not a shard")  # not ours: stays
    model.save_pretrained(tmp_path, dtype=torch.bfloat16)
    index = json.loads((tmp_path / INDEX).read_text())
    assert {f.name for f in shard_files(tmp_path)} == set(index["weight_map"].values())
    seen = {}
    for f in shard_files(tmp_path):
        for n, t in load_file(str(f)).items():
            assert n not in seen, f"{n} in two shards"
            seen[n] = t
    assert set(seen) == set(index["weight_map"])
    assert all(t.dtype != torch.float32 or n.endswith(F32_SUFFIXES) for n, t in seen.items())
    assert (tmp_path / "notes.safetensors.txt").is_file()

# ---- broken checkpoints --------------------------------------------------------------------------------------------
def copy_single_shard(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (shard,) = shard_files(dst)
    return shard, load_file(str(shard))


def test_all_problems_reported_together(bf16_dir, tmp_path):
    shard, tensors = copy_single_shard(bf16_dir, tmp_path)
    missing = "language_model.model.layers.1.mlp_res_proj.weight"
    missing_expert = "language_model.model.layers.3.block_sparse_moe.experts.9.w2.weight"
    reshaped = "language_model.model.layers.0.self_attn.q_proj.weight"
    del tensors[missing], tensors[missing_expert]
    tensors[reshaped] = tensors[reshaped][:-1].clone()
    tensors["language_model.model.layers.0.bogus.weight"] = torch.zeros(3)
    tensors["language_model.model.layers.1.block_sparse_moe.experts.99.w1.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError) as err:
        K3ForCausalLM.from_pretrained(tmp_path)
    msg = str(err.value)
    for needle in (missing, "experts [9]", "layers.3.block_sparse_moe.experts.w2", reshaped,
                   "model.layers.0.bogus.weight", "experts.99.w1.weight", "5 problems"):
        assert needle in msg, (needle, msg)


def test_truncated_shard_names_the_file(bf16_dir, tmp_path):
    shard, _ = copy_single_shard(bf16_dir, tmp_path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_missing_shard_file_is_reported(model, tmp_path):
    model.save_pretrained(tmp_path, max_shard_bytes=1 << 20)
    victim = shard_files(tmp_path)[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        K3ForCausalLM.from_pretrained(tmp_path)



@pytest.mark.parametrize("where", ["../outside/model.safetensors", "ABSOLUTE", "sub/../../outside/model.safetensors",
                                   7, None, "LIST"])
def test_a_hostile_index_cannot_send_the_loader_outside_the_directory(model, tmp_path, where):
    """An index whose weight_map names a shard outside the checkpoint (`..`, an absolute path) or no file at all:
    every loader refuses it, naming the index, although the file it points to outside is a valid shard of the
    same model that the loaders would otherwise read."""
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    model.save_pretrained(ckpt, dtype=None)
    outside.mkdir()
    (shard,) = shard_files(ckpt)
    (outside / "model.safetensors").write_bytes(shard.read_bytes())
    shard.unlink()
    index = json.loads((ckpt / INDEX).read_text())
    if where == "LIST":
        index["weight_map"] = sorted(index["weight_map"])
    else:
        target = str(outside / "model.safetensors") if where == "ABSOLUTE" else where
        index["weight_map"] = {n: target for n in index["weight_map"]}
    (ckpt / INDEX).write_text(json.dumps(index))
    for load in (K3ForCausalLM.from_pretrained, verify_checkpoint, lambda d: load_rank_shard(d, RankLayout(0, 2))):
        with pytest.raises(CheckpointError, match=INDEX) as err:
            load(ckpt)
        assert "not a file inside the checkpoint directory" in str(err.value) or "not a valid" in str(err.value)

# ---- `k3 convert` never writes over what OUT holds ---------------------------------------------------------------------
def convert_cli(src, dst, capsys, *extra) -> tuple[int, list[str]]:
    from k3.cli import main
    code = main(["convert", str(src), str(dst), "--experts", "bf16", *extra])  # (expert width 48: no MXFP4)
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    return code, [l for l in err if l.startswith("k3 ")]  # the messages, without the progress bar


def tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_convert_refuses_a_non_empty_out(bf16_dir, tmp_path, capsys):
    out = tmp_path / "old-model"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model-00001-of-00003.safetensors").write_bytes(b"an older model's shard")
    before = tree(out)
    code, err = convert_cli(bf16_dir, out, capsys)
    assert code == 2 and err == [f"k3 convert: error: OUT {out} is not empty: give a new directory (convert never "
                                 f"writes over files)"]
    assert tree(out) == before
    f = tmp_path / "a-file"
    f.write_text("x")
    code, err = convert_cli(bf16_dir, f, capsys)
    assert code == 2 and err == [f"k3 convert: error: OUT {f} is a file, not a directory"] and f.read_text() == "x"
    # an empty OUT (made by the user beforehand) is fine, and so is one that does not exist yet
    (tmp_path / "empty").mkdir()
    for dst in (tmp_path / "empty", tmp_path / "new"):
        code, err = convert_cli(bf16_dir, dst, capsys)
        assert code == 0 and err == []
        assert load_file(str(dst / "model-00001-of-00001.safetensors")).keys() == \
            load_file(str(bf16_dir / "model-00001-of-00001.safetensors")).keys()


@pytest.mark.parametrize("failure", ["full disk", "Ctrl-C"])
def test_failed_convert_leaves_no_partial_model(bf16_dir, tmp_path, capsys, monkeypatch, failure):
    import errno
    import os

    import k3.checkpoint.convert as convert_mod
    real, calls = convert_mod.save_file, []

    def writer(tensors, path, **kw):  # the second shard fails
        calls.append(path)
        if len(calls) == 2:
            if failure == "Ctrl-C":
                raise KeyboardInterrupt
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(tensors, path, **kw)

    monkeypatch.setattr(convert_mod, "save_file", writer)
    out = tmp_path / "converted"
    code, err = convert_cli(bf16_dir, out, capsys, "--shard-size", "200K")
    assert len(calls) == 2
    if failure == "Ctrl-C":
        assert code == 130 and err == ["k3 convert: interrupted"]
    else:
        assert code == 2 and err == [f"k3 convert: error: writing OUT {out} failed: No space left on device; its "
                                     f"partial files were removed"]
    assert sorted(os.listdir(tmp_path)) == []  # neither OUT nor its temporary sibling


def test_a_killed_converts_temporary_is_removed_by_the_next(bf16_dir, tmp_path, capsys):
    """SIGKILL leaves `.OUT.tmp-convert-PID` behind (no handler runs); the next convert to that OUT removes it once
    its process is gone, and never touches the temporary of a convert still running."""
    import subprocess
    import sys

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "converted"
        dead = tmp_path / f".converted.tmp-convert-{killed.pid}"
        live = tmp_path / f".converted.tmp-convert-{running.pid}"
        for d in (dead, live):
            d.mkdir()
            (d / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
        code, err = convert_cli(bf16_dir, out, capsys)
        assert code == 0 and err == []
        assert not dead.exists()
        assert (live / "model-00001-of-00002.safetensors").read_bytes() == b"half a shard"
        assert (out / "config.json").is_file()
    finally:
        running.kill()
        running.wait()
