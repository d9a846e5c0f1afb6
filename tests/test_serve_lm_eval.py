"""lm-evaluation-harness (the `lm_eval` package, unmodified) against a live `k3 serve` of a random tiny model,
set up as a user would: `local-completions` with the server's own tokenizer (`/tokenizer_info` + `/tokenize`,
found by lm-eval's auto-detection), batch_size 4 and concurrent requests, on the local tasks in
tests/lm_eval_task/ (multiple choice, loglikelihood_rolling, generate_until). Every per-sample loglikelihood
lm-eval reports must equal the model's own log-softmax of the same tokens (a plain forward), its aggregate
scores must follow from those, and its generations must be the model's greedy ones; `local-chat-completions`
must run the generation task too. The other tokenizer set-up, transformers loading the model directory's
tokenizer.json (`tokenizer_backend=huggingface`), must give the same rolling loglikelihoods. The failure this
guards against: echo without per-prompt-token logprobs made lm-eval score every choice 0 and report accuracy 1.0
and bits-per-byte 0, with exit code 0."""
import math
from pathlib import Path

import pytest
import torch

from k3.data import Tokenizer
from live_serve import k3_serve, save_tiny_model

KEY, NAME = "sk-lm-eval-test", "k3-tiny"
REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "lm_eval_task"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval")
    model = save_tiny_model(d / "model")
    with k3_serve(d / "model", KEY, NAME, d / "serve.log") as url:
        yield url, model, d / "model"


@pytest.fixture
def lm_eval_env(monkeypatch):
    """No network (the datasets are local JSON files, their paths relative to the repository root); lm-eval's
    API models read the key from OPENAI_API_KEY."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.chdir(REPO)


def api_model(name: str, **model_args):
    """lm-eval's API model as `--model NAME --model_args ...` builds it."""
    from lm_eval.api.registry import get_model

    return get_model(name)(**model_args)


def evaluate(lm, tasks: list[str], **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(TASKS)),
                                   log_samples=True, **kwargs)


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one plain forward (float64 log-softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def score(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's logprobs, whether each continuation token is the argmax) — lm-eval's pair."""
    ids = context + continuation
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(context) - 1:-1].double()
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(continuation)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's documented split for causal models: trailing context spaces move to the continuation, the whole
    text is encoded and the continuation is what follows the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def greedy_text(model, tok, prompt: str, max_new: int, stop: str) -> str:
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new)[0, len(ids):].tolist()
    return tok.decode(out, skip_special_tokens=True).split(stop)[0]


def check_rolling(samples: list, result: dict, model, tok, prefix: int) -> None:
    """loglikelihood_rolling: each whole document after lm-eval's prefix token (one window: short texts), and
    the bits per byte that follow from them."""
    assert len(samples) == 4
    total_ll, total_bytes = 0.0, 0
    for s in samples:
        text = s["doc"]["text"]
        want = float(token_logprobs(model, [prefix] + tok.encode(text)).sum())
        assert float(s["filtered_resps"][0]) == pytest.approx(want, abs=1e-4), text
        total_ll, total_bytes = total_ll + want, total_bytes + len(text.encode())
    assert result["bits_per_byte,none"] == pytest.approx(-total_ll / total_bytes / math.log(2), rel=1e-6)


@pytest.mark.slow
def test_lm_eval_completions_scores_equal_k3_logprobs(served, lm_eval_env):
    url, model, _ = served
    tok = Tokenizer.from_file()
    lm = api_model("local-completions", model=NAME, base_url=f"{url}/v1/completions", auth_token=KEY, batch_size=4,
                   num_concurrent=2, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # lm-eval found /tokenizer_info and /tokenize (behind the key)
    # lm-eval reads BOS id 0 as missing (`bos_token_id or eos_token_id`), so rolling windows start at EOS
    assert lm.eot_token_id == tok.eos_id and lm.prefix_token_id in (tok.bos_id, tok.eos_id)
    out = evaluate(lm, ["k3_tiny_mc", "k3_tiny_rolling", "k3_tiny_gen"])
    samples, results = out["samples"], out["results"]

    # multiple choice: every choice's loglikelihood and greediness, and the accuracy that follows from them
    mc = samples["k3_tiny_mc"]
    assert len(mc) == 6
    correct = []
    for s in mc:
        pairs = [tuple(a) for a in s["arguments"]]  # (context, continuation) per choice
        want = [score(model, *encode_pair(tok, c, x)) for c, x in pairs]
        got = s["filtered_resps"]
        assert len(got) == len(s["doc"]["choices"])
        for (g_ll, g_greedy), (w_ll, w_greedy), (_, cont) in zip(got, want, pairs):
            assert g_ll == pytest.approx(w_ll, abs=1e-4), cont
            assert g_greedy is w_greedy, cont
        correct.append(max(range(len(want)), key=lambda i: want[i][0]) == s["doc"]["answer"])
    assert results["k3_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    check_rolling(samples["k3_tiny_rolling"], results["k3_tiny_rolling"], model, tok, lm.prefix_token_id)

    # generate_until: the model's greedy continuation, cut at the task's stop string
    gen = samples["k3_tiny_gen"]
    assert len(gen) == 4
    for s in gen:
        kw = s["arguments"][0][1]  # (prompt, generation kwargs)
        want = greedy_text(model, tok, s["doc"]["prompt"], kw["max_gen_toks"], kw["until"][0])
        assert s["filtered_resps"][0] == want


@pytest.mark.slow
def test_lm_eval_with_the_model_directory_tokenizer(served, lm_eval_env):
    """The other set-up: transformers loads the tokenizer.json k3 saved beside the model (BOS id 0 read right)."""
    url, model, directory = served
    tok = Tokenizer.from_file()
    lm = api_model("local-completions", model=NAME, base_url=f"{url}/v1/completions", batch_size=4,
                   tokenizer_backend="huggingface", tokenizer=str(directory), max_retries=1)
    assert lm.prefix_token_id == tok.bos_id
    out = evaluate(lm, ["k3_tiny_rolling"])
    check_rolling(out["samples"]["k3_tiny_rolling"], out["results"]["k3_tiny_rolling"], model, tok, tok.bos_id)


@pytest.mark.slow
def test_lm_eval_chat_completions_generates(served, lm_eval_env):
    url = served[0]
    lm = api_model("local-chat-completions", model=NAME, base_url=f"{url}/v1/chat/completions", max_retries=1)
    out = evaluate(lm, ["k3_tiny_gen"], apply_chat_template=True, gen_kwargs={"reasoning_effort": "none"})
    gen = out["samples"]["k3_tiny_gen"]
    assert len(gen) == 4
    texts = [s["filtered_resps"][0] for s in gen]
    assert all(isinstance(t, str) for t in texts), texts
    assert any(t.strip() for t in texts), texts  # a random model says something within 8 tokens
