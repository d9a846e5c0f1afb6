"""A vision-language model served by `k3 serve --nproc 2` (experts over two ranks, the vision tower on each):
a chat request with an image gets the text and logprobs `--nproc 1` gives (with expert replicas re-placed every
two steps), and a different image changes them."""
import httpx
import torch

from k3.data import Tokenizer
from live_serve import k3_serve
from test_vision_serve import data_url, png
from tiny_vlm import make_tiny_vlm


def chat(url: str, image: bytes) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=120, json={
        "model": "m", "max_tokens": 6, "temperature": 0, "logprobs": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                  {"type": "image_url", "image_url": {"url": data_url(image)}}]}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["message"]["content"], "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]}


def test_http_nproc2_with_an_image_equals_nproc1(tmp_path):
    d = tmp_path / "vlm"
    make_tiny_vlm().save_pretrained(d, dtype=None)
    Tokenizer.from_file().save_pretrained(d)
    answers = {}
    for n, extra in ((1, ()), (2, ("--ep-replicas", "1", "--ep-rebalance-steps", "2"))):  # replicas re-placed too
        with k3_serve(d, "k", "m", tmp_path / f"log{n}", "--nproc", str(n), *extra) as url:
            answers[n] = [chat(url, png(seed)) for seed in (1, 2)]
    assert "expert replicas 1 a rank per MoE layer, re-placed every 2 steps" in (tmp_path / "log2").read_text()
    for one, two in zip(answers[1], answers[2]):
        assert one["text"] == two["text"] and len(one["logprobs"]) == 6
        torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]), rtol=1e-4, atol=1e-4)
    # the image reaches the model on both ranks: another image, other logprobs
    assert answers[2][0]["logprobs"] != answers[2][1]["logprobs"]
