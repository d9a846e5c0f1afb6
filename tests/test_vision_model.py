"""K3ForConditionalGeneration: pads replaced in order by projector rows, labels at image positions ignored,
prefill + decode with an image equals a full forward, and a tiny VLM's save → load round trip (released names,
BF16 vision tensors, the text-only loader still skipping them with a warning)."""
import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open

from k3 import K3ForCausalLM
from k3.data import Tokenizer
from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration, image_token_ids
from k3.vision.preprocess import batch_images, preprocess_image
from tiny_vlm import PAD
from two_layer_model import two_layer_config


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


def image(seed: int, W=56, H=28):
    rng = np.random.default_rng(seed)
    return preprocess_image(Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), "RGB"),
                            VisionConfig.preset("tiny"))


def prompt(tok, images, text=" what is this?"):
    ids = [tok.bos_id]
    for im in images:
        ids += image_token_ids(tok, im)
    return torch.tensor([ids + tok.encode(text)])


def test_media_block_layout(tok):
    im = image(0, 84, 56)
    ids = image_token_ids(tok, im)
    sp = tok.special_tokens
    assert ids[0] == sp["<|media_begin|>"] and ids[-1] == sp["<|media_end|>"]
    assert tok.decode(ids[1:ids.index(sp["<|media_content|>"])]) == "image 84x56"
    assert ids.count(PAD) == im.num_tokens == 3 * 2


def test_pads_are_replaced_in_order_by_projector_rows(vlm, tok):
    ims = [image(1), image(2, 28, 56)]
    ids = prompt(tok, ims)
    pv, grid = batch_images(ims)
    rows = vlm.encode_images(pv, grid)
    assert rows.shape == (sum(im.num_tokens for im in ims), 128)
    embeds = vlm.language_model.model.embed_tokens(ids).clone()
    pos = (ids[0] == PAD).nonzero().flatten()
    for j, p in enumerate(pos.tolist()):  # independent splice: j-th pad ← j-th row
        embeds[0, p] = rows[j]
    want = vlm.language_model(ids, inputs_embeds=embeds).logits
    got = vlm(ids, pv, grid).logits
    assert torch.allclose(got, want, atol=1e-5)
    # causal: positions before the first pad do not see the image; later ones do
    other = vlm(ids, *batch_images([image(3), image(4, 28, 56)])).logits
    first = int(pos[0])
    assert torch.allclose(other[0, :first], got[0, :first], atol=1e-6)
    assert not torch.allclose(other[0, -1], got[0, -1], atol=1e-4)


def test_wrong_pad_count_is_a_clear_error(vlm, tok):
    ims = [image(1)]
    ids = prompt(tok, ims)
    with pytest.raises(ValueError, match="media_pad"):
        vlm(ids[:, :-6], *batch_images(ims))
    with pytest.raises(ValueError, match="media_pad"):
        vlm(ids)  # pads but no images
    with pytest.raises(ValueError, match="together"):
        vlm(ids, pixel_values=batch_images(ims)[0])


def test_labels_at_image_positions_are_ignored(vlm, tok):
    ims = [image(5)]
    ids = prompt(tok, ims)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # next-token targets, pads included
    out = vlm(ids, *batch_images(ims), labels=labels)
    logits = out.logits[0]
    keep = [t for t in range(ids.shape[1]) if ids[0, t] != PAD and labels[0, t] not in (PAD, -100)]
    want = F.cross_entropy(logits[keep].float(), labels[0, keep])
    assert abs(out.loss.item() - want.item()) < 1e-5


def test_prefill_then_decode_equals_full_forward(vlm, tok):
    ims = [image(6)]
    ids = prompt(tok, ims)
    gen = torch.cat(list(vlm.stream_generate(ids, ims, max_new_tokens=5)))
    seq = torch.cat([ids, gen[None]], 1)
    logits = vlm(seq, *batch_images(ims)).logits[0]
    T = ids.shape[1]
    assert gen.tolist() == logits[T - 1:T + 4].argmax(-1).tolist()
    encoded = []
    vlm.encode, plain_encode = (lambda *a: encoded.append(1) or plain_encode(*a)), vlm.encode
    try:  # refused when called, before the first token and before the tower encodes the images
        with pytest.raises(ValueError, match="temperature must be a number >= 0"):
            vlm.stream_generate(ids, ims, max_new_tokens=5, temperature=-1.0)
    finally:
        del vlm.encode
    assert encoded == []


def test_save_load_round_trip(vlm, tok, tmp_path):
    vlm.save_pretrained(tmp_path / "f32", dtype=None)
    back = K3ForConditionalGeneration.from_pretrained(tmp_path / "f32")
    sd, sd2 = vlm.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    ims = [image(7)]
    ids = prompt(tok, ims)
    assert torch.equal(vlm(ids, *batch_images(ims)).logits, back(ids, *batch_images(ims)).logits)
    assert back.media_placeholder_token_id == PAD and back.vision_config == vlm.vision_config
    # released names; BF16 vision tensors when saved as released; the index covers them
    vlm.save_pretrained(tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["vision_config"]["vt_hidden_size"] == 64 and cfg["media_placeholder_token_id"] == PAD
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]
    vision = sorted(n for n in index if n.startswith(("vision_tower.", "mm_projector.")))
    assert len(vision) == 2 * 6 + 3 + 3
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in vision and "mm_projector.proj.2.weight" in vision
    with safe_open(str(tmp_path / "bf16" / index[vision[0]]), "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in vision} == {"BF16"}
    # the text-only loader still reads the directory, skipping the vision tensors with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text_only = K3ForCausalLM.from_pretrained(tmp_path / "f32")
    assert any("skipped 18 vision tensors" in str(w.message) for w in caught)
    assert torch.equal(text_only.lm_head.weight, vlm.lm_head.weight)


def test_config_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="text_hidden_size"):
        K3ForConditionalGeneration(two_layer_config(), VisionConfig.preset("tiny", text_hidden_size=64), PAD)
    with pytest.raises(ValueError, match="media_placeholder_token_id"):
        K3ForConditionalGeneration(two_layer_config(), VisionConfig.preset("tiny"), 10**6)
