"""Checkpoints with MXFP4 routed experts: the kimi-k3 plan equals the released inventory, save → load gives the
fake-quant model's logits (float and packed inference), QAT export, streaming memory, convert/verify, and
broken checkpoints reported in one clear error."""
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint.convert import convert_checkpoint, verify_checkpoint
from k3.checkpoint.hf import CheckpointError, load_pretrained, mxfp4_quantization_config
from k3.checkpoint.plan import plan_tensors, plan_totals
from k3.ops.mx import mxfp4_quantize_dequantize, mxfp4_unpack
from k3.ops.mx_experts import enable_qat
from test_checkpoint import read_headers, released_layout, shard_files  # the SPEC §2 layout, written independently

SPEC_QUANT_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                      "scale_dtype": "torch.uint8"}



def small_config() -> K3Config:
    # expert width (96) != latent width (64), both multiples of 32, so [I, L] and [L, I] are told apart
    return K3Config.preset("tiny").replace(moe_intermediate_size=96, vocab_size=512)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(small_config()).eval()


@pytest.fixture(scope="module")
def mx_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("mxfp4")
    model.save_pretrained(path, dtype=None, experts="mxfp4", max_shard_bytes=100_000)
    return path


def ids():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


def fake_quant_copy(model):
    q = K3ForCausalLM(model.config).eval()
    q.load_state_dict(model.state_dict())
    with torch.no_grad():
        for n, p in q.named_parameters():
            if ".experts.w" in n:
                p.copy_(mxfp4_quantize_dequantize(p))
    return q


def mxfp4_layout(cfg):
    """released_layout with each expert `.weight` [out, in] replaced by the two MXFP4 tensors (SPEC §2, §4)."""
    out = {}
    for n, (shape, dt) in released_layout(cfg).items():
        if ".experts." in n:
            stem = n.removesuffix(".weight")
            out[stem + ".weight_packed"] = ((shape[0], shape[1] // 2), "U8")
            out[stem + ".weight_scale"] = ((shape[0], shape[1] // 32), "U8")
        else:
            out[n] = (shape, dt)
    return out


# ---- the released inventory ----------------------------------------------------------------------------------------
def test_kimi_k3_plan_matches_the_released_inventory():
    cfg = K3Config.preset("kimi-k3")
    count, nbytes = plan_totals(cfg, "mxfp4")
    assert (count, nbytes) == (497_052, 1_559_965_606_912)  # SPEC §1/§2 and the released headers
    # Independently: the SPEC §2 layout of a one-expert model, then 92 layers x 896 experts x 3 matrices, each
    # 33,030,144 / 3 values stored as half a byte plus one scale byte per 32.
    one = mxfp4_layout(cfg.replace(num_experts=1, num_experts_per_token=1))
    per_value = lambda dt: {"BF16": 2, "F32": 4, "U8": 1}[dt]
    non_expert = {n: v for n, v in one.items() if ".experts." not in n}
    for n, (shape, dt) in non_expert.items():  # the router still scores all 896 experts
        if n.endswith(("gate.weight", "gate.e_score_correction_bias")):
            non_expert[n] = ((cfg.num_experts, *shape[1:]), dt)
    base_bytes = sum(math.prod(s) * per_value(d) for s, d in non_expert.values())
    assert nbytes == base_bytes + 92 * 896 * (33_030_144 // 2 + 33_030_144 // 32)
    assert count == len(non_expert) + 92 * 896 * 6


def test_plan_of_a_small_config_is_the_released_layout():
    cfg = small_config()
    got = {s.name: (s.shape, s.dtype) for s in plan_tensors(cfg, "mxfp4")}
    assert got == mxfp4_layout(cfg)
    assert {s.name: (s.shape, s.dtype) for s in plan_tensors(cfg, "bf16")} == released_layout(cfg)


# ---- files ---------------------------------------------------------------------------------------------------------
def test_mxfp4_files_have_the_planned_layout_and_quantization_config(mx_dir):
    want = {n: (s, "F32" if d == "F32" else ("U8" if d == "U8" else "F32")) for n, (s, d) in mxfp4_layout(small_config()).items()}
    assert read_headers(mx_dir) == want  # dtype=None keeps the float32 master weights
    cfg = json.loads((mx_dir / "config.json").read_text())
    q = cfg["text_config"]["quantization_config"]
    assert "quantization_config" not in cfg  # inside text_config only
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["quantization_status"] == "compressed"
    (group,) = q["config_groups"].values()
    assert {k: group["weights"][k] for k in SPEC_QUANT_WEIGHTS} == SPEC_QUANT_WEIGHTS
    assert group["input_activations"] is None
    for part in ("self_attn", "shared_experts", "lm_head", "vision_tower", "mm_projector", "mlp\\.(gate"):
        assert any(part in rule for rule in q["ignore"]), part
    index = json.loads((mx_dir / "model.safetensors.index.json").read_text())
    assert len(shard_files(mx_dir)) > 5
    assert index["metadata"]["total_size"] == sum(
        math.prod(s) * {"F32": 4, "U8": 1}[d] for s, d in read_headers(mx_dir).values())
    assert verify_checkpoint(mx_dir)["problems"] == []


def test_save_load_gives_the_fake_quant_models_logits(model, mx_dir):
    with torch.no_grad():
        want = fake_quant_copy(model)(ids()).logits
        got = load_pretrained(mx_dir)(ids()).logits
        packed = load_pretrained(mx_dir, packed_experts=True)
        got_packed = packed(ids()).logits
    assert torch.equal(got, want)
    assert torch.allclose(got_packed, want, atol=1e-5, rtol=1e-5)
    assert packed.model.layers[1].block_sparse_moe.experts.w1_packed.dtype == torch.uint8
    # a packed model saves back to the same bytes
    assert not hasattr(packed.model.layers[1].block_sparse_moe.experts, "w1")


def test_packed_model_resaves_identically(mx_dir, tmp_path):
    packed = load_pretrained(mx_dir, packed_experts=True)
    packed.save_pretrained(tmp_path, dtype=None)
    a, b = {}, {}
    for d, out in ((mx_dir, a), (tmp_path, b)):
        for f in shard_files(d):
            out |= load_file(str(f))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_serving_load_keeps_mxfp4_packed_and_never_quantizes_float_experts(model, mx_dir, tmp_path):
    """k3 serve on a GPU loads with keep_mxfp4: an MXFP4 checkpoint stays packed (same logits as the dequantised
    load), while a float checkpoint keeps float experts (packing them would quantize the weights silently)."""
    from k3.vision.multimodal import load_model
    packed = load_model(mx_dir, keep_mxfp4=True)
    assert any(n.endswith("w1_packed") for n, _ in packed.named_buffers())
    assert not any(n.endswith(".experts.w1") for n, _ in packed.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(packed.eval()(ids()).logits, load_model(mx_dir).eval()(ids()).logits)
    model.save_pretrained(tmp_path, dtype=None)  # float experts
    kept = load_model(tmp_path, keep_mxfp4=True)
    assert not any(n.endswith("_packed") for n, _ in kept.named_buffers())
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(), model.state_dict().values()))


def test_qat_export_reproduces_the_qat_forward(tmp_path):
    torch.manual_seed(3)
    qat = enable_qat(K3ForCausalLM(small_config()).eval())
    with torch.no_grad():
        want = qat(ids()).logits
    qat.save_pretrained(tmp_path, dtype=None, experts="mxfp4")
    for packed in (False, True):
        loaded = enable_qat(load_pretrained(tmp_path, packed_experts=packed))  # MXFP8 activations, as in training
        with torch.no_grad():
            assert torch.allclose(loaded(ids()).logits, want, atol=1e-5, rtol=1e-5), packed


def test_loads_names_without_prefix_and_skips_vision(model, mx_dir, tmp_path):
    for f in mx_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    first = shard_files(tmp_path)[0]
    for f in shard_files(tmp_path):
        t = {n.removeprefix("language_model."): v for n, v in load_file(str(f)).items()}
        if f == first:
            t["vision_tower.blocks.0.weight"] = torch.zeros(4)
        save_file(t, str(f))
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {n.removeprefix("language_model."): v for n, v in idx["weight_map"].items()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.warns(UserWarning, match="skipped 1 vision"):
        loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, fake_quant_copy(model)(ids()).logits)


# ---- streaming memory ------------------------------------------------------------------------------------------------
def test_streaming_load_holds_at_most_one_shard(mx_dir):
    stats = {}
    load_pretrained(mx_dir, stats=stats)
    # bytes of tensors read from the files and alive at the same time never exceed one shard
    assert 0 < stats["peak_live_bytes"] <= stats["largest_shard_bytes"]


def test_streaming_load_peak_rss_is_about_one_shard(tmp_path):
    # A model of ~40 MB (float32) in 4 MB shards. Measured in a fresh process: peak RSS during the load minus
    # (RSS before + the model's own bytes) must stay within a couple of shards, far below a second model copy.
    cfg = K3Config.preset("tiny").replace(vocab_size=512, num_experts=64, moe_intermediate_size=256, hidden_size=256,
                                          routed_expert_hidden_size=128)
    torch.manual_seed(0)
    K3ForCausalLM(cfg).save_pretrained(tmp_path, dtype=None, max_shard_bytes=4 << 20)
    script = textwrap.dedent(f"""
        import resource, torch, gc
        from k3 import K3Config, K3ForCausalLM
        from k3.checkpoint.hf import load_pretrained
        from k3.memory import peak_resident_bytes as rss
        torch.set_num_threads(1)
        # the first meta-device build costs ~70 MB of one-time torch initialisation: pay it before measuring
        with torch.device("meta"):
            K3ForCausalLM(K3Config.preset("tiny"), init=False)
        base = rss()
        m = load_pretrained({str(tmp_path)!r})
        model_bytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        print(base, rss(), model_bytes)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    base, peak, model_bytes = map(int, out.stdout.split())
    extra = peak - base - model_bytes
    shard = max(f.stat().st_size for f in shard_files(tmp_path))
    print(f"model {model_bytes / 2**20:.1f} MiB, largest shard {shard / 2**20:.1f} MiB, extra peak {extra / 2**20:.1f} MiB")
    assert model_bytes > 8 * shard
    assert extra < 3 * shard + (8 << 20)


# ---- convert and verify ----------------------------------------------------------------------------------------------
def test_convert_round_trip_and_verify(mx_dir, tmp_path):
    v = convert_checkpoint(mx_dir, tmp_path / "bf16", "bf16", max_shard_bytes=1 << 30)
    assert v["problems"] == [] and v["experts"] == "bf16"
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())["text_config"]
    back = convert_checkpoint(tmp_path / "bf16", tmp_path / "mx", "mxfp4", max_shard_bytes=200_000)
    assert back["problems"] == []
    a, b = {}, {}
    for d, out in ((mx_dir, a), (tmp_path / "mx", b)):
        for f in shard_files(d):
            out |= load_file(str(f))
    assert a.keys() == b.keys()
    for n in a:
        if n.endswith("weight_packed"):  # values round-trip exactly; the bytes may differ, e.g. a block whose
            # max rounded down to 3·2^e re-encodes as 6·2^(e-1)
            stem = n.removesuffix("_packed")
            assert torch.equal(mxfp4_unpack(a[n], a[stem + "_scale"]), mxfp4_unpack(b[n], b[stem + "_scale"])), n
        elif not n.endswith("weight_scale"):
            assert torch.equal(a[n], b[n]), n


def test_verify_lists_what_is_wrong(mx_dir, tmp_path):
    for f in mx_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    f = next(f for f in shard_files(tmp_path) if any(n.endswith("weight_scale") for n in load_file(str(f))))
    t = load_file(str(f))
    victim = sorted(n for n in t if n.endswith("weight_scale"))[0]
    t[victim] = t[victim].float()
    save_file(t, str(f))
    problems = verify_checkpoint(tmp_path)["problems"]
    assert any(victim in p and "F32" in p and "expected U8" in p for p in problems), problems
    assert any("total_size" in p for p in problems) and any("bytes of text tensors" in p for p in problems)
    index = tmp_path / "model.safetensors.index.json"
    for metadata in (5, [], None):  # not a mapping: a problem to list, not an AttributeError
        index.write_text(json.dumps({**json.loads(index.read_text()), "metadata": metadata}))
        assert any("index total_size None" in p for p in verify_checkpoint(tmp_path)["problems"])


# ---- broken checkpoints ------------------------------------------------------------------------------------------------
def copy_and_edit(src, dst, edit):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in shard_files(dst):
        tensors |= load_file(str(f))
        f.unlink()
    edit(tensors)
    save_file(tensors, str(dst / "model-00001-of-00001.safetensors"))
    (dst / "model.safetensors.index.json").unlink()


def test_mismatched_mxfp4_experts_are_listed_together(mx_dir, tmp_path):
    p = "language_model.model.layers.2.block_sparse_moe.experts."

    def edit(t):
        t[p + "0.w1.weight_scale"] = t[p + "0.w1.weight_scale"].float()  # mis-typed
        t[p + "1.w2.weight_packed"] = t[p + "1.w2.weight_packed"][:, :-1].clone()  # mis-shaped
        del t[p + "2.w3.weight_scale"]  # half of a pair missing
        t[p + "3.w1.weight"] = torch.zeros(96, 64)  # both encodings of one expert
        t[p + "99.w1.weight_packed"] = torch.zeros(96, 32, dtype=torch.uint8)  # no such expert

    copy_and_edit(mx_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    msg = str(err.value)
    for needle in ("0.w1.weight_scale: dtype F32, expected U8", "1.w2.weight_packed: shape (64, 47), expected (64, 48)",
                   "missing tensor experts [2] of language_model.model.layers.2.block_sparse_moe.experts.w3",
                   "experts.3.w1: expert stored both", "unexpected tensor " + p + "99.w1.weight_packed"):
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_shard_names_the_file(mx_dir, tmp_path, damage):
    for f in mx_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    victim = shard_files(tmp_path)[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + data[20:])
    with pytest.raises(CheckpointError, match=victim.name):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=victim.name):
        verify_checkpoint(tmp_path)


def test_quantization_config_helper_is_specs():
    q = mxfp4_quantization_config()
    assert q == K3Config.preset("kimi-k3").quantization_config and q is not K3Config.preset("kimi-k3").quantization_config


# ---- QAT expert path ---------------------------------------------------------------------------------------------------
def test_qat_experts_match_an_explicit_fake_quant_loop_with_straight_through_grads():
    from k3.ops.mx import mxfp8_quantize_dequantize
    from k3.ops.mx_experts import qat_expert_situ_mlp
    from k3.ops.situ import situ_glu

    g = torch.Generator().manual_seed(5)
    E, I, L = 3, 64, 32
    ws = [torch.randn(E, *s, generator=g, dtype=torch.float64) * 0.2 for s in ((I, L), (I, L), (L, I))]
    x = torch.randn(7, L, generator=g, dtype=torch.float64)
    counts = torch.tensor([3, 0, 4])
    params = [w.clone().requires_grad_() for w in ws]
    y = qat_expert_situ_mlp(x, counts, *params)
    # reference: per-expert loop over explicitly quantized copies (leaf tensors, so their grads are dL/dq)
    qs = [mxfp4_quantize_dequantize(w).requires_grad_() for w in ws]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = mxfp8_quantize_dequantize(x[start:start + n])
        h = situ_glu(xe @ qs[0][e].t(), xe @ qs[1][e].t())
        outs.append(_ste8(h) @ qs[2][e].t())  # MXFP8 on the down projection's input, identity gradient
        start += n
    ref = torch.cat(outs)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    for p, q in zip(params, qs):  # straight-through: the master weights get exactly dL/d(quantized weights)
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert params[0].grad[1].abs().sum() == 0  # expert 1 received no tokens


def _ste8(h):
    from k3.ops.mx import mxfp8_quantize_dequantize
    return h + (mxfp8_quantize_dequantize(h.detach()) - h.detach())
