"""Images in serving and on the command line: a prefix-cache hit with an image equals a cold run, the same text
with a different image never reuses the image's cached state, chunked prefill may split an image, bad images
get a 4xx from the server and a clear error (exit 2) from `k3 generate --image`."""
import base64
import io

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from k3 import K3ForCausalLM
from k3.cli import main
from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine
from k3.serve.api import create_app
from k3.serve.sampling import SamplingParams
from k3.vision.config import VisionConfig
from k3.vision.multimodal import image_token_ids
from k3.vision.preprocess import preprocess_image
from tiny_vlm import PAD
from two_layer_model import two_layer_config


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


def png(seed: int, W=56, H=56) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def engine(model, tok, **kw):
    cfg = dict(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=64, max_num_seqs=4)
    cfg.update(kw)
    return LLMEngine(model, tok, EngineConfig(**cfg))


def request(tok, seed):
    im = preprocess_image(png(seed), VisionConfig.preset("tiny"))
    ids = [tok.bos_id, *tok.encode(" look:"), *image_token_ids(tok, im), *tok.encode(" what is in the picture?")]
    return ids, im


def reference(vlm, ids, im, n):
    return torch.cat(list(vlm.stream_generate(torch.tensor([ids]), [im], max_new_tokens=n))).tolist()


GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def test_prefix_hit_with_an_image_equals_cold_run(vlm, tok):
    ids, im = request(tok, 1)
    eng = engine(vlm, tok)
    cold = eng.generate([ids], GREEDY, images=[[im]])[0]
    assert cold.output_ids == reference(vlm, ids, im, 5)
    hot = eng.generate([ids], GREEDY, images=[[im]])[0]
    last_pad = max(i for i, t in enumerate(ids) if t == PAD)
    assert hot.cache.restored_tokens > last_pad  # resumed past the whole image
    assert hot.output_ids == cold.output_ids


def test_same_text_different_image_never_hits_the_image(vlm, tok):
    ids_a, im_a = request(tok, 1)
    ids_b, im_b = request(tok, 2)
    assert ids_a == ids_b and im_a.digest != im_b.digest  # identical token ids, different pixels
    eng = engine(vlm, tok)
    eng.generate([ids_a], GREEDY, checkpoint_at=[[4, 8, 12, 16]], images=[[im_a]])
    out = eng.generate([ids_b], GREEDY, images=[[im_b]])[0]
    first_pad = ids_a.index(PAD)
    assert out.cache.matched_tokens <= first_pad and out.cache.restored_tokens <= first_pad
    assert out.output_ids == reference(vlm, ids_b, im_b, 5)


def test_chunked_prefill_splitting_an_image_equals_reference(vlm, tok):
    ids, im = request(tok, 3)
    eng = engine(vlm, tok, max_batch_tokens=3, prefix_caching=False)
    assert eng.generate([ids], GREEDY, images=[[im]])[0].output_ids == reference(vlm, ids, im, 5)


def test_fixed_shape_decode_steps_with_an_image_equal_reference(vlm, tok):
    """decode_graphs=True (the CPU runs the graphs' fixed-shape step eagerly) with one-token steps: the prompt's
    one-token chunks, image rows among them, stay on the eager path that splices the image in; the decode steps
    after it take the fixed-shape path; the tokens equal the reference's."""
    ids, im = request(tok, 5)
    eng = engine(vlm, tok, max_batch_tokens=1, prefix_caching=False, decode_graphs=True)
    assert eng.generate([ids], GREEDY, images=[[im]])[0].output_ids == reference(vlm, ids, im, 5)
    assert eng.runner.graphs.entries  # the decodes went through it


def test_image_prompts_arriving_beside_in_flight_decodes_equal_reference(vlm, tok):
    """Async output with the decode graphs' fixed-shape step: image prompts admitted while another request
    decodes launch beside its in-flight decodes (their image rows spliced into the chunk's eager forward, the
    decodes' ids read on the device); every request's tokens equal the reference's."""
    reqs = [request(tok, 6 + i) for i in range(3)]
    eng = engine(vlm, tok, max_batch_tokens=16, prefix_caching=False, decode_graphs=True)
    fed_beside_prompts = []
    run = eng.runner.run

    def counting_run(seqs, lens, sample_rows, ids=None):
        fed_beside_prompts.append(ids is not None and any(s.in_prefill and s.mm for s in seqs))
        return run(seqs, lens, sample_rows, ids)
    eng.runner.run = counting_run
    params = SamplingParams(max_tokens=8, temperature=0.0)
    rids, outs, step = [], {}, 0
    while len(rids) < len(reqs) or eng.has_unfinished():
        if step % 3 == 0 and len(rids) < len(reqs):
            ids, im = reqs[len(rids)]
            rids.append(eng.add_request(ids, params, images=[im]))
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
        assert step < 200
    assert any(fed_beside_prompts)
    for rid, (ids, im) in zip(rids, reqs):
        assert outs[rid] == reference(vlm, ids, im, 8)


def test_engine_refuses_mismatched_images(vlm, tok):
    ids, im = request(tok, 4)
    eng = engine(vlm, tok)
    with pytest.raises(ValueError, match="media_pad"):
        eng.add_request(ids, GREEDY)  # pads without images
    with pytest.raises(ValueError, match="media_pad"):
        eng.add_request(ids, GREEDY, images=[im, im])


def chat_body(url, text="what is this?"):
    return {"model": "k3", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


def test_server_accepts_data_urls_and_refuses_bad_images_with_400(vlm, tok):
    app = create_app(engine(vlm, tok, max_model_len=200), tok, "k3")
    with TestClient(app) as client:
        ok = client.post("/v1/chat/completions", json=chat_body(data_url(png(5))))
        assert ok.status_code == 200, ok.text
        n_tokens = preprocess_image(png(5), vlm.vision_config).num_tokens
        assert ok.json()["usage"]["prompt_tokens"] > n_tokens
        bad = {"remote": "https://example.com/a.png", "base64": "data:image/png;base64,!!!!",
               "decoded": data_url(b"not a png at all"), "image/": "data:text/plain;base64,aGVsbG8=",
               "aspect": data_url(_png_of_size(1, 400))}
        for match, url in bad.items():
            r = client.post("/v1/chat/completions", json=chat_body(url))
            assert r.status_code == 400, (match, r.text)
            err = r.json()["error"]
            assert err["param"] == "messages" and match in err["message"] and "content[1]" in err["message"]



def test_server_never_reads_a_file_a_client_names(vlm, tok, tmp_path):
    """An image URL that is a path on the server's machine (an image there, a file there that is not one, one that
    does not exist) is refused alike, without reading it: a client learns neither what a file holds nor whether
    it exists."""
    image = tmp_path / "private.png"
    image.write_bytes(png(7))
    other = tmp_path / "secret.txt"
    other.write_text("password")
    app = create_app(engine(vlm, tok, max_model_len=200), tok, "k3")
    answers = []
    with TestClient(app) as client:
        for url in (str(image), str(other), str(tmp_path / "absent.png"), "private.png", f"file://{image}"):
            r = client.post("/v1/chat/completions", json=chat_body(url))
            assert r.status_code == 400, (url, r.text)
            message = r.json()["error"]["message"]
            assert "data URL" in message and "not found" not in message and "decoded" not in message
            answers.append(message.replace(url, "URL").replace("; remote URLs are not fetched", ""))
    assert len(set(answers)) == 1, answers

def _png_of_size(W, H) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (W, H)).save(buf, format="PNG")
    return buf.getvalue()


def test_text_only_server_refuses_images(tok):
    torch.manual_seed(0)
    text = K3ForCausalLM(two_layer_config()).eval()
    app = create_app(engine(text, tok, max_model_len=200), tok, "k3")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=chat_body(data_url(png(6))))
        assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]


def test_cli_generate_with_image(vlm, tok, tmp_path, capsys):
    d = tmp_path / "vlm"
    vlm.save_pretrained(d, dtype=None)
    good, corrupt = tmp_path / "a.png", tmp_path / "bad.png"
    good.write_bytes(png(7))
    corrupt.write_bytes(b"\x89PNG garbage")
    argv = ["generate", "--model", str(d), "--prompt", " hi", "--max-new-tokens", "3", "--temperature", "0"]
    assert main(argv + ["--image", str(good)]) == 0
    capsys.readouterr()
    assert main(argv + ["--image", str(corrupt)]) == 2
    assert "--image" in capsys.readouterr().err
    assert main(argv + ["--image", str(tmp_path / "missing.png")]) == 2
    assert "not found" in capsys.readouterr().err
    text_dir = tmp_path / "text"
    vlm.language_model.save_pretrained(text_dir, dtype=None)
    assert main(["generate", "--model", str(text_dir), "--prompt", "x", "--image", str(good)]) == 2
    assert "vision" in capsys.readouterr().err
