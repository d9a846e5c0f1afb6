"""k3 serve as a drop-in for vLLM's OpenAI server (issue 19), live over HTTP: echo with prompt logprobs against the
model's own log-softmax, batched prompts, character text offsets, vLLM's prompt_logprobs, the routes and metrics a
vLLM deployment expects (both Prometheus parsers), /openapi.json documenting every body, limits, and hostile
inputs (fuzzed) that must all be 4xx."""
import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from k3 import K3Config, K3ForCausalLM, __version__
from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine
from k3.serve import protocol as P
from k3.serve.api import create_app
from k3.serve.local_server import free_port, local_server

KEY, NAME = "proto-key", "k3-proto"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
MAX_LEN = 200


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    m.reset_parameters(seed=5)
    return m.eval()


def make_engine(model, tok):
    return LLMEngine(model, tok, EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4, max_batch_tokens=64,
                                              max_num_seqs=32, max_model_len=MAX_LEN))


@pytest.fixture(scope="module")
def server(model, tok):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = make_engine(model, tok)
    with local_server(create_app(eng, tok, NAME, api_key=KEY), as_k3_serve=True) as url:
        yield url, eng
    torch.set_num_threads(n)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=kw.pop("timeout", 60), **kw)


def complete(url, **body):
    r = post(url, "/v1/completions", {"model": NAME, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def log_softmax(model, ids):
    """The model's own log-probabilities at every position of ids (a plain full forward), float64."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def greedy(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, eos_token_id=None)[0, len(ids):].tolist()


# ---- echo, logprobs, offsets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_are_the_models_own_log_softmax(server, model, tok, max_tokens):
    url, _ = server
    prompt = "Now is the winter of our discontent"
    ids = tok.encode(prompt)
    body = complete(url, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens, ignore_eos=True)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    ref = log_softmax(model, ids)
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    for j in range(1, len(ids)):
        top2 = torch.topk(ref[j - 1], 2).indices.tolist()
        keys = set(lp["top_logprobs"][j])
        assert {tok.decode([t]) for t in top2} <= keys and tok.decode([ids[j]]) in keys
    assert choice["text"].startswith(prompt) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens and body["usage"]["prompt_tokens"] == len(ids)
    if max_tokens:
        out = greedy(model, ids, 1)
        assert lp["token_logprobs"][-1] == pytest.approx(ref[-1, out[0]].item(), abs=1e-4)


def test_text_offset_counts_characters_of_the_returned_text(server, tok):
    url, _ = server
    prompt = "naïve café — 東京 😀 ok"
    body = complete(url, prompt=prompt, echo=True, logprobs=0, max_tokens=6, ignore_eos=True)
    choice = body["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    whole = 0
    for token, off in zip(lp["tokens"], offsets):
        if "\ufffd" not in token:  # a token holding whole characters sits at its offset, in characters
            assert text[off:off + len(token)] == token, (token, off)
            whole += 1
    assert whole >= 5  # ("naïve", " café", " ok", ...: the check above ran on real tokens)
    n_prompt = len(tok.encode(prompt))
    assert offsets[n_prompt] == len(prompt)  # the first generated token starts right after the echoed prompt
    assert len(prompt.encode()) != len(prompt)  # (the prompt's bytes and characters differ: offsets are characters)


def test_streamed_echo_equals_the_plain_response(server):
    url, _ = server
    body = {"model": NAME, "prompt": "Once more unto the breach", "echo": True, "logprobs": 1, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    plain = post(url, "/v1/completions", body).json()["choices"][0]
    text, token_logprobs, offsets = "", [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    token_logprobs += c["logprobs"]["token_logprobs"]
                    offsets += c["logprobs"]["text_offset"]
    assert text == plain["text"]
    assert token_logprobs == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert offsets == plain["logprobs"]["text_offset"]


def test_vllm_prompt_logprobs_field(server, model, tok):
    url, _ = server
    prompt = "Friends, Romans, countrymen"
    ids = tok.encode(prompt)
    choice = complete(url, prompt=prompt, prompt_logprobs=3, max_tokens=1)["choices"][0]
    plp = choice["prompt_logprobs"]
    ref = log_softmax(model, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert entry[str(ids[j])]["logprob"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        top3 = torch.topk(ref[j - 1], 3).indices.tolist()
        assert {str(t) for t in top3} <= set(entry)
        assert entry[str(top3[0])]["rank"] == 1 and entry[str(top3[0])]["decoded_token"] == tok.decode([top3[0]])
    assert choice["logprobs"] is None and choice["text"] and not choice["text"].startswith(prompt)


# ---- batched prompts -----------------------------------------------------------------------------------------
def test_batched_prompts_index_choices_prompt_major(server, model, tok):
    url, _ = server
    texts = ["To be, or not to be", "All the world's a stage"]
    for prompt in (texts, [tok.encode(t) for t in texts]):
        body = complete(url, prompt=prompt, n=2, max_tokens=3, ignore_eos=True, return_token_ids=True)
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        for c in body["choices"]:
            ids = tok.encode(texts[c["index"] // 2])
            assert c["prompt_token_ids"] == ids and c["token_ids"] == greedy(model, ids, 3)
        assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)  # each prompt once
        assert body["usage"]["completion_tokens"] == 12


def test_openai_sdk_batched_prompts_and_new_sampling_fields(server, model, tok):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ids = tok.encode("The quality of mercy")
    first = greedy(model, ids, 1)[0]
    r = client.completions.create(model=NAME, prompt=["The quality of mercy"] * 3, max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3
    assert all(c.text != tok.decode([first]) for c in r.choices)  # the bias reached the sampler
    # the greedy token with the bias is the reference's second best
    assert {tok.encode(c.text) == [torch.topk(log_softmax(model, ids)[-1], 2).indices[1].item()]
            for c in r.choices} == {True}


# ---- refusals ---------------------------------------------------------------------------------------------
UNSUPPORTED = [
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "n": P.MAX_N + 1}, "n"),
    ("/v1/completions", {"prompt": ["x"] * (P.MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * (P.MAX_STOP_STRINGS + 1)}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=[u[2] + "-" + u[0].split("/")[-1] for u in UNSUPPORTED])
def test_what_k3_cannot_honour_is_a_400_naming_the_field(server, path, body, param):
    url, _ = server
    r = post(url, path, {"model": NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_best_of_equal_to_n_is_accepted(server):
    url, _ = server
    assert len(complete(url, prompt="x", n=2, best_of=2, max_tokens=1)["choices"]) == 2


def test_chat_max_completion_tokens_zero_generates_nothing(server):
    url, _ = server
    r = post(url, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                           "max_completion_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["finish_reason"] == "length"
    assert not body["choices"][0]["message"]["content"]


# ---- hostile inputs: every one a 4xx ------------------------------------------------------------------------
HOSTILE_VALUES = ["\ud800", "a\udfffb", -1, 2**64, 2**64 + 5, -(2**63), 10**400, 1e308, float("nan"), float("inf"),
                  "", [], {}, None, True, [1] * 5000, ["x"] * 2000, {"\udc00": 1}, [[-1]], [[2**70]], "A" * 100_000,
                  {str(i): 1.0 for i in range(3000)}, list(range(100_000)), [{"role": "user", "content": "\ud83d"}]]
FIELDS = ["prompt", "max_tokens", "seed", "n", "stop", "stop_token_ids", "logit_bias", "temperature", "top_p",
          "top_k", "min_p", "logprobs", "prompt_logprobs", "presence_penalty", "repetition_penalty", "min_tokens",
          "echo", "best_of", "checkpoint_at", "stream_options", "policy_version", "user"]


def _json(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity on purpose: Python's json reads them


def test_named_attacks_are_4xx(server):
    url, eng = server
    attacks = [
        {"model": NAME, "prompt": "hello \ud800 world"},
        {"model": NAME, "prompt": ["ok", "bad \udfff"]},
        {"model": NAME, "prompt": "x", "seed": 2**64},
        {"model": NAME, "prompt": "x", "seed": -1},
        {"model": NAME, "prompt": "x", "stop": ["\ud800"]},
        {"model": NAME, "prompt": "x", "stop_token_ids": list(range(3_000_000))},
        {"model": NAME, "prompt": "x", "temperature": float("nan")},
        {"model": NAME, "prompt": [[]]},
    ]
    for body in attacks:
        r = httpx.post(url + "/v1/completions", content=_json(body), headers=JSON_AUTH,
                       timeout=60)
        assert 400 <= r.status_code < 500, (str(body)[:80], r.text[:200])
        assert r.json()["error"]["message"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi \udbff"}]}
    r = httpx.post(url + "/v1/chat/completions", content=_json(chat), headers=JSON_AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # valid JSON within the parser's depth, past what rendering a schema or a message recurses through
    nested = '{"type": "object", "properties": {"a": ' * 450 + '{"type": "string"}' + "}}" * 450
    user = '{"role": "user", "content": "x"}'
    tool = f'{{"type": "function", "function": {{"name": "f", "parameters": {nested}}}}}'
    for body in (f'{{"model": "{NAME}", "messages": [{user}], "tool_choice": "required", "tools": [{tool}]}}',
                 f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": [{nested}]}}]}}'):
        r = httpx.post(url + "/v1/chat/completions", content=body.encode(), headers=JSON_AUTH, timeout=60)
        assert 400 <= r.status_code < 500, r.text[:300]
    deep = b'{"model": "' + NAME.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url + "/v1/completions", content=deep, headers=JSON_AUTH)
    assert r.status_code == 400


def test_fuzzed_fields_never_give_a_5xx(server):
    url, eng = server
    rng = random.Random(19)
    statuses = []
    with httpx.Client(headers=JSON_AUTH, timeout=60) as h:
        for _ in range(150):
            body = {"model": NAME, "prompt": "fuzz", "max_tokens": 2, "temperature": 0}
            for field in rng.sample(FIELDS, rng.randint(1, 3)):
                body[field] = rng.choice(HOSTILE_VALUES)
            path = "/v1/completions"
            if rng.random() < 0.25:
                path = "/v1/chat/completions"
                body["messages"] = body.pop("prompt")
            r = h.post(url + path, content=_json(body))
            statuses.append(r.status_code)
            assert r.status_code < 500, (str(body)[:200], r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "param"}
    assert sum(400 <= s < 500 for s in statuses) > 100  # the fuzz mostly hit refusals, not generations
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    deadline = time.time() + 10
    while (eng.pool.num_used_blocks or eng.has_unfinished()) and time.time() < deadline:
        time.sleep(0.05)
    assert eng.pool.num_used_blocks == 0 and eng.pool.num_used_slots == 0


def test_health_answers_while_a_million_token_prompt_is_tokenized(server, tok):
    url, _ = server
    prompt = "to be or not " * 250_000  # ~1M tokens: seconds of tokenising
    result = {}

    def send():
        result["r"] = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1},
                                 headers=AUTH, timeout=300)
        result["done"] = time.monotonic()
    th = threading.Thread(target=send)
    th.start()
    time.sleep(0.3)  # the body is on its way
    answered = []
    with httpx.Client(timeout=30) as h:
        while th.is_alive():
            t0 = time.monotonic()
            assert h.get(url + "/health").status_code == 200
            answered.append((t0, time.monotonic()))
            time.sleep(0.05)
    th.join()
    r = result["r"]
    assert r.status_code == 400 and "maximum sequence length" in r.json()["error"]["message"]
    during = [(a, b) for a, b in answered if b < result["done"]]
    assert len(during) >= 3, answered  # /health kept answering while the prompt was tokenised
    assert max(b - a for a, b in during) < 1.0


# ---- routes, errors, limits ------------------------------------------------------------------------------------
def test_routes_a_vllm_deployment_expects(server, tok):
    url, eng = server
    card = httpx.get(url + f"/v1/models/{NAME}", headers=AUTH).json()
    assert card["id"] == NAME and card["object"] == "model" and card["max_model_len"] == MAX_LEN
    r = httpx.get(url + "/v1/models/gpt-4", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/version").json() == {"version": __version__}
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/tokenizer_info").status_code == 401  # behind the key
    info = httpx.get(url + "/tokenizer_info", headers=AUTH).json()
    # what lm-eval's RemoteTokenizer does with it: eos_token_id = /tokenize(eos_token)[0]
    eos = post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.eos_id]
    assert "{%" in info["chat_template"] and info["model_max_length"] == MAX_LEN


def test_405_names_the_allowed_methods(server):
    url, _ = server
    r = httpx.get(url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_openapi_documents_every_body_and_live_responses_match(server):
    url, _ = server
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ok = op["responses"]["200"]["content"]
            if path != "/metrics":
                ref = ok["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert ref in schemas, (path, ref)
            if method == "post" and path != "/ping":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert ref in schemas and schemas[ref]["properties"], (path, ref)
    assert {"prompt", "echo", "logit_bias", "prompt_logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]["exclusiveMaximum"] == 2**64
    P.CompletionResponse.model_validate(complete(url, prompt="x", max_tokens=2, logprobs=1, echo=True))
    chat = post(url, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    P.ChatResponse.model_validate(chat)
    P.ModelList.model_validate(httpx.get(url + "/v1/models", headers=AUTH).json())
    P.TokenizerInfo.model_validate(httpx.get(url + "/tokenizer_info", headers=AUTH).json())
    P.ErrorResponse.model_validate(post(url, "/v1/completions", {"model": NAME}).json())
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, json={
            "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(P.ChatStreamChunk.model_validate(c) for c in chunks) and chunks[-1]["usage"]


# vLLM's buckets, from vllm/v1/metrics/loggers.py
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0]
VLLM_KINDS = {
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:request_success": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
}


def test_metrics_have_vllms_names_and_parse_as_prometheus_and_openmetrics(server):
    url, eng = server
    complete(url, prompt="Metrics, please", max_tokens=3, n=2, ignore_eos=True)
    aborted = _success(httpx.get(url + "/metrics").text, "abort")
    body = {"model": NAME, "prompt": "leave early", "max_tokens": 150, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        next(r.iter_lines())  # the first token: the request is running; then the client goes
    deadline = time.time() + 10
    while _success(httpx.get(url + "/metrics").text, "abort") == aborted and time.time() < deadline:
        time.sleep(0.1)
    text = httpx.get(url + "/metrics").text
    assert _success(text, "abort") == aborted + 1
    om = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    for families in (list(parse_prometheus(text)), list(parse_openmetrics(om.text))):
        kinds = {f.name.removesuffix("_total") if f.type == "counter" else f.name: f.type for f in families}
        for name, kind in VLLM_KINDS.items():
            assert kinds.get(name) == kind, (name, kinds.get(name))
        for f in families:
            assert all(s.labels.get("model_name") == NAME for s in f.samples), f.name
        e2e = next(f for f in families if f.name == "vllm:e2e_request_latency_seconds")
        les = [float(s.labels["le"]) for s in e2e.samples if s.name.endswith("_bucket")]
        assert les == VLLM_REQUEST_LATENCY + [float("inf")]
        n = next(f for f in families if f.name == "vllm:request_params_n")
        assert any(s.name.endswith("_sum") and s.value >= 2 for s in n.samples)
        counts = {f.name: next(s.value for s in f.samples if s.name.endswith("_count")) for f in families
                  if f.type == "histogram"}
        finished = counts["vllm:e2e_request_latency_seconds"]
        assert finished >= 2  # the n=2 request's two sequences, at least
        for phase in ("queue", "prefill", "decode", "inference"):  # every finished sequence timed in each phase
            assert counts[f"vllm:request_{phase}_time_seconds"] == finished
        assert counts["vllm:request_generation_tokens"] == finished and counts["vllm:iteration_tokens_total"] > 3


def _success(text: str, reason: str) -> float:
    for f in parse_prometheus(text):
        if f.name == "vllm:request_success":
            return sum(s.value for s in f.samples if s.labels.get("finished_reason") == reason)
    return 0.0


# ---- a second server: limits, and an engine that fails mid-stream -------------------------------------------------
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's crash
def test_body_limits_and_a_stream_that_fails_mid_way(model, tok):
    eng = make_engine(model, tok)
    real_step, calls = eng.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3 and eng.has_unfinished():
            raise RuntimeError("device lost")
        return real_step()
    eng.step = failing_step
    with local_server(create_app(eng, tok, NAME, max_request_bytes=4096, body_timeout_s=1.0)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x" * 10_000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000
        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413

        def slow():  # a client that stops sending half-way
            yield b'{"model": '
            time.sleep(2.5)
            yield b'"x"}'
        r = httpx.post(url + "/v1/completions", content=slow(), headers={"Content-Type": "application/json"})
        assert r.status_code == 408
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": NAME, "prompt": "a stream that breaks", "max_tokens": 50, "stream": True,
                "ignore_eos": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["type"] == "server_error" and "device lost" in error["message"]
        assert any("choices" in json.loads(e[6:]) for e in events[:-2])  # tokens went out before the failure


def test_api_key_from_the_environment_and_max_model_len_flag(tmp_path, monkeypatch):
    from k3 import cli, envs
    from k3.serve import api

    got = {}
    monkeypatch.setattr(api, "serve", lambda *a, **kw: got.update(kw))
    monkeypatch.setattr(cli, "check_listen_address", lambda host, port: None)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with envs.override(api_key="from-env"):
        assert cli.main(["serve", "--model", str(tmp_path)]) == 0
        assert got["api_key"] == "from-env" and got["engine_config"].max_model_len is None
        assert cli.main(["serve", "--model", str(tmp_path), "--api-key", "flag", "--max-model-len", "1024"]) == 0
        assert got["api_key"] == "flag" and got["engine_config"].max_model_len == 1024
    assert "from-env" not in repr(envs.parse({"K3_API_KEY": "from-env"}))  # a secret stays out of reprs
    assert envs.parse({"K3_API_KEY": "k"}).api_key == "k"
    got.clear()
    assert cli.main(["serve", "--model", str(tmp_path), "--max-model-len", "5000"]) == 2
    assert not got  # refused before loading anything



@pytest.mark.parametrize("flag, env", [("", None), (None, ""), (" key", None), ("ke y", None), ("k\u00e9y", None),
                                       ("key\n", None), (None, "key\t")])
def test_an_api_key_no_client_could_send_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys, flag, env):
    """An empty key (`--api-key "$KEY"` or `K3_API_KEY=$KEY` with KEY unset) served with auth off (the variable)
    or passed a bare 'Bearer ' (the flag); a space, control or non-ASCII character never arrives in a header as
    sent. Each is exit 2 naming where the key came from, before the model loads; create_app's auth refuses it too."""
    from k3 import cli, envs
    from k3.serve import api

    got = {}
    monkeypatch.setattr(api, "serve", lambda *a, **kw: got.update(kw))
    monkeypatch.setattr(cli, "check_listen_address", lambda host, port: None)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with envs.override(api_key=env):
        assert cli.main(["serve", "--model", str(tmp_path), *(["--api-key", flag] if flag is not None else [])]) == 2
    err = capsys.readouterr().err
    assert ("--api-key" if flag is not None else "$K3_API_KEY") in err and "error" in err and not got
    assert envs.parse({"K3_API_KEY": ""}).api_key == "" and envs.parse({}).api_key is None
    with pytest.raises(ValueError, match="api_key"):
        api.BearerAuth(None, api_key=flag if flag is not None else env)

@pytest.mark.parametrize("command, missing", [
    (["serve"], "fastapi"), (["serve"], "uvicorn"), (["serve", "--nproc", "2"], "fastapi"),
    (["serve", "--nproc", "2"], "uvicorn"), (["bench", "serve"], "fastapi"), (["bench", "serve"], "aiohttp")])
def test_serve_without_the_serve_extra_says_so_in_one_line(tmp_path, monkeypatch, capsys, command, missing):
    """A machine without the serve extra (here: the module made unimportable, and k3's server module unloaded so
    that it is imported again): `k3 serve`, from one process or as ranks, and `k3 bench serve` exit 2 with one line
    naming the missing module and the extra, before any rank starts or a model loads; no traceback."""
    import sys

    from k3 import cli
    from k3.serve import bench, distributed

    started = []
    monkeypatch.setattr(distributed, "serve_from_cli", lambda *a: started.append(a))
    monkeypatch.setattr(bench, "make_model", lambda *a: started.append(a))
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.delitem(sys.modules, "k3.serve.api")
    monkeypatch.delattr("k3.serve.api")
    (tmp_path / "config.json").write_text("{}")
    flags = ["--port", str(free_port())] if command[0] == "serve" else []
    assert cli.main([*command, "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    name = " ".join(command[:2]) if command[0] == "bench" else "serve"
    assert err.strip() == f"k3 {name}: error: {missing} is missing: install the serve extra (pip install 'k3[serve]')"
    assert not started
