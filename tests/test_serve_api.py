"""The OpenAI-compatible server, live: uvicorn on 127.0.0.1 (a free port) in a thread, driven by the real
`openai` client and raw httpx. Outputs are checked against the model's own `generate`; bad requests must
get a 4xx error in OpenAI's shape; disconnects and finished requests must leave the pool empty."""
import asyncio
import json
import logging
import socket
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine, head_timeout
from k3.serve.api import create_app
from k3.serve.chat_template import ChatOutputParser, render_chat
from k3.serve.local_server import local_server

KEY, NAME = "test-key", "k3-tiny"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    m.reset_parameters(seed=3)
    return m.eval()


def engine(model, tok) -> LLMEngine:
    return LLMEngine(model, tok, EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4, max_batch_tokens=256,
                                              max_num_seqs=32, max_model_len=200))


@pytest.fixture(scope="module")
def server(model, tok):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = engine(model, tok)
    with local_server(create_app(eng, tok, NAME, api_key=KEY), as_k3_serve=True) as url:
        yield url, eng
    torch.set_num_threads(n)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def reference(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n)[0, len(ids):].tolist()


def wait_pool_empty(eng, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if eng.pool.num_used_blocks == 0 and eng.pool.num_used_slots == 0 and not eng.has_unfinished():
            return True
        time.sleep(0.02)
    return False


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_completion_plain_and_streaming_match_generate(client, server, model, tok):
    prompt = "To be, or not to be"
    want = tok.decode(reference(model, tok.encode(prompt), 6), skip_special_tokens=True)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, **GREEDY)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(tok.encode(prompt))
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 6
    # the second identical prompt restores the first one's end-of-prompt checkpoint
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert wait_pool_empty(server[1])


def test_completion_logprobs_and_token_prompt(client, model, tok):
    ids = tok.encode("Hark")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=3, logprobs=2, **GREEDY)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    first = r.choices[0].logprobs.token_logprobs[0]
    assert first == pytest.approx(float(lp.max()), abs=1e-4)
    assert len(r.choices[0].logprobs.top_logprobs[0]) == 2


def test_completion_token_ids_and_policy_version(server, model, tok):
    """k3 extensions: `return_token_ids` gives exactly the generated ids (whole and per streamed chunk, also
    tokens whose text is held back or empty); `policy_version` keeps the prefix cache apart per version."""
    url, eng = server
    ids = tok.encode("Once more unto the breach")
    want = reference(model, ids, 12)
    body = {"model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "policy_version": 7, "checkpoint_at": [4]}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as h:
        r = h.post("/v1/completions", json=body).json()
        assert r["choices"][0]["token_ids"] == want and r["choices"][0]["prompt_token_ids"] == ids
        assert r["k3_cache"]["matched_tokens"] == 0  # version 7 is new to this server
        streamed = []
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    for c in json.loads(line[5:])["choices"]:
                        streamed += c["token_ids"]
        assert streamed == want
        again = h.post("/v1/completions", json=body).json()
        assert again["k3_cache"]["restored_tokens"] > 0  # same version: the cache is used
        other = h.post("/v1/completions", json={**body, "policy_version": 8}).json()
        assert other["k3_cache"]["matched_tokens"] == 0 and other["choices"][0]["token_ids"] == want
        plain = h.post("/v1/completions", json={k: v for k, v in body.items() if k != "return_token_ids"}).json()
        assert "token_ids" not in plain["choices"][0]
        for bad in ({"policy_version": 1.5}, {"policy_version": True}, {"checkpoint_at": [999]},
                    {"return_token_ids": "yes"}):
            r = h.post("/v1/completions", json={**body, **bad})
            assert r.status_code == 400, (bad, r.text)
    assert wait_pool_empty(eng)


def chat_expected(model, tok, messages, n):
    ids, _ = render_chat(tok, messages)
    parser = ChatOutputParser(tok)
    reasoning = content = ""
    for t in reference(model, ids, n):
        a, b = parser.step(t)
        reasoning, content = reasoning + a, content + b
    return reasoning, content


def test_chat_plain_and_streaming_match_generate(client, model, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who goes there?"}]
    reasoning, content = chat_expected(model, tok, messages, 7)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=7, **GREEDY)
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (reasoning, content)
    assert reasoning + content  # something was generated
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=7, stream=True, **GREEDY)
    got_r = got_c = ""
    for c in stream:
        d = c.choices[0].delta
        got_r += (d.model_extra or {}).get("reasoning_content") or ""
        got_c += d.content or ""
    assert (got_r, got_c) == (reasoning, content)


def test_chat_token_ids(server, model, tok):
    """`return_token_ids` on chat: the generated ids (whole, and per streamed chunk including tokens that add
    no text) and the rendered prompt's ids, exactly as the model's own `generate` gives them."""
    url, eng = server
    messages = [{"role": "user", "content": "What light through yonder window breaks?"}]
    ids, _ = render_chat(tok, messages)
    want = reference(model, ids, 10)
    body = {"model": NAME, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as h:
        r = h.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["token_ids"] == want and r["choices"][0]["prompt_token_ids"] == ids
        streamed, chunks = [], 0
        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    for c in json.loads(line[5:])["choices"]:
                        streamed += c.get("token_ids", [])
                        chunks += "token_ids" in c
        assert streamed == want and chunks == len(want)  # one chunk per engine step, one token each
        plain = h.post("/v1/chat/completions", json={**body, "return_token_ids": False}).json()
        assert "token_ids" not in plain["choices"][0]
        assert h.post("/v1/chat/completions", json={**body, "return_token_ids": "yes"}).status_code == 400
    assert wait_pool_empty(eng)


def test_multi_turn_chat_over_http_hits_the_cache(client, tok):
    messages = [{"role": "user", "content": "Good morrow."}]
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, **GREEDY)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        m = r.choices[0].message
        messages += [{"role": "assistant", "content": m.content, "reasoning_content": m.model_extra["reasoning_content"]},
                     {"role": "user", "content": f"Again, {turn}."}]
    assert all(c > 0 for c in cached[1:])


def test_32_concurrent_streams_are_complete_and_correct(server, model, tok):
    url, eng = server
    prompts = [f"Line {i}: the king" for i in range(32)]
    want = [tok.decode(reference(model, tok.encode(p), 5), skip_special_tokens=True) for p in prompts]

    async def one(c, p):
        text, finish = "", None
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=5, stream=True, **GREEDY)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(main())
    assert [t for t, _ in got] == want
    assert all(f == "length" for _, f in got)
    assert wait_pool_empty(eng)


def test_client_disconnect_frees_blocks_and_state_slot(server):
    url, eng = server
    body = {"model": NAME, "prompt": "Now is the winter of our discontent", "max_tokens": 150, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            first = next(l for l in lines if l.startswith("data:"))
            assert json.loads(first[5:])["choices"]
            assert eng.pool.num_used_slots == 1 or eng.has_unfinished()
    assert wait_pool_empty(eng)  # cancelled long before 150 tokens would have finished
    assert eng.metrics.generation_tokens > 0


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Now is the winter of our discontent"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Speak."}]})])
def test_non_streaming_client_disconnect_frees_blocks_and_state_slot(server, monkeypatch, path, body):
    """A plain request produces output every step, so the server must watch the connection on a clock, not
    only when the engine pauses: a client that gives up cancels its sequence long before max_tokens."""
    url, eng = server
    step = eng.step

    def slow_step():  # ~100 ms per token: 150 tokens would take 15 s, the client leaves after 2 s (a loaded CPU
        time.sleep(0.1)  # can take a second for the first step, so 2 s still sees tokens before it leaves)
        return step()
    monkeypatch.setattr(eng, "step", slow_step)
    before = eng.metrics.generation_tokens
    body = {**body, "model": NAME, "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=httpx.Timeout(30, read=2.0)) as h:
        with pytest.raises(httpx.ReadTimeout):  # the timeout closes the connection: the client is gone
            h.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert wait_pool_empty(eng)
    generated = eng.metrics.generation_tokens - before
    assert 0 < generated < 100, generated  # started, then cancelled (not run to 150)


PROTOCOLS = {"httptools": ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol"),
             "h11": ("uvicorn.protocols.http.h11_impl", "H11Protocol")}
PIPELINING = [pytest.param(impl, loop, id=f"{impl}-{loop}") for impl in PROTOCOLS for loop in ("asyncio", "uvloop")]


@contextmanager
def slow_server(model, tok, monkeypatch, impl, loop):
    """A fresh engine at 50 ms a token behind the protocol `k3 serve` uses, on `impl`'s uvicorn protocol and `loop`
    → (a connected raw socket, the engine, the messages uvicorn logged at ERROR)."""
    pytest.importorskip(loop)
    module, name = PROTOCOLS[impl]
    monkeypatch.setattr(head_timeout, "AutoHTTPProtocol", getattr(pytest.importorskip(module), name))  # its base
    eng = engine(model, tok)
    step = eng.step

    def slow_step():  # 50 ms a token: a request is still running when the client leaves
        time.sleep(0.05)
        return step()
    monkeypatch.setattr(eng, "step", slow_step)
    errors = logging.Handler(logging.ERROR)
    errors.emit = (logged := []).append
    protocol = head_timeout.head_deadline_protocol(head_timeout.HEADER_TIMEOUT_S)
    with local_server(create_app(eng, tok, NAME), http=protocol, loop=loop) as url:
        logging.getLogger("uvicorn.error").addHandler(errors)  # after uvicorn has configured its loggers
        try:
            host, port = url.removeprefix("http://").split(":")
            # reads wait out a loaded machine (a 10 s limit failed a clean clone beside other jobs): what these
            # tests time is bounded by their own deadlines, not the socket's
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                yield sock, eng, logged
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)


def completion_request(max_tokens: int, stream: bool) -> bytes:
    """A greedy /v1/completions request of `max_tokens` tokens, as raw HTTP/1.1 bytes."""
    body = json.dumps({"model": NAME, "prompt": "Now is the winter of our discontent", "max_tokens": max_tokens,
                       "stream": stream, "ignore_eos": True, "temperature": 0}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: k3\r\n\r\n"


@pytest.mark.parametrize("impl,loop", PIPELINING)
def test_a_stream_whose_client_pipelines_a_second_request_then_leaves_is_cancelled(model, tok, monkeypatch, impl,
                                                                                   loop):
    """HTTP/1.1 pipelining over a raw socket, under the protocol `k3 serve` uses: a streaming request, a second
    request head sent while the first streams, then the socket closed. uvicorn's httptools protocol parses that
    head at once and keeps only the newest request, so the close reached only the second one: on asyncio's loop the
    stream ran on to max_tokens for nobody; on uvloop's its next write raised (an error logged) and its generator,
    left to the garbage collector, ran on until collected (h11 leaves the head unparsed until the stream ends). Each
    way the stream must end cleanly: its sequence freed within 2 s (150 held steps take 7.5 s), no error logged."""
    with slow_server(model, tok, monkeypatch, impl, loop) as (sock, eng, logged):
        sock.sendall(completion_request(150, stream=True))
        got = b""
        while b"data:" not in got:  # the response head and the first event: the stream has begun
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        sock.sendall(HEALTH_REQUEST)
        time.sleep(0.3)  # the server reads the second head before the close (else it sees the close alone)
        assert eng.has_unfinished()  # still streaming
        sock.close()
        assert wait_pool_empty(eng, 2.0)  # cancelled, not run on for nobody
    assert not [r.getMessage() for r in logged]


def send_pipelined_behind_a_running_completion(sock, eng, max_tokens: int) -> None:
    """A plain (non-streaming) completion, then, once it generates, a second request head on the same socket."""
    sock.sendall(completion_request(max_tokens, stream=False))
    deadline = time.monotonic() + 10
    while eng.metrics.generation_tokens == 0:  # nothing comes back until it is done: watch the engine instead
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.sendall(HEALTH_REQUEST)


@pytest.mark.parametrize("impl,loop", PIPELINING)
def test_a_plain_request_whose_client_pipelines_a_second_request_then_leaves_is_cancelled(model, tok, monkeypatch,
                                                                                          impl, loop):
    """The same attack on a non-streaming request: both uvicorn protocols stop reading the socket once a pipelined
    head arrives (flow control) and a plain response writes nothing until it is done, so nothing noticed the close
    and all 150 tokens were generated for nobody (freed after ~9 s; without the pipelined head, at once). The
    server must notice the hang-up of a connection it is not reading: freed within 2 s, no error logged."""
    with slow_server(model, tok, monkeypatch, impl, loop) as (sock, eng, logged):
        send_pipelined_behind_a_running_completion(sock, eng, 150)
        time.sleep(0.3)  # the server reads the second head, and stops reading, before the close
        assert eng.has_unfinished()
        sock.close()
        assert wait_pool_empty(eng, 2.0)  # cancelled, not run on for nobody
    assert not [r.getMessage() for r in logged]


def read_response(f) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length from a socket's file → (status, body)."""
    status = int(f.readline().split()[1])
    headers = dict(line.decode().lower().split(":", 1) for line in iter(f.readline, b"\r\n"))
    return status, f.read(int(headers["content-length"]))


@pytest.mark.parametrize("impl,loop", PIPELINING)
def test_a_pipelined_request_on_an_open_connection_is_answered_after_the_first(model, tok, monkeypatch, impl, loop):
    """What the hang-up watch must not break: a client that pipelines and stays (the watch polls its unread socket
    a few times while the first request runs) gets both answers, in order."""
    with slow_server(model, tok, monkeypatch, impl, loop) as (sock, eng, logged):
        send_pipelined_behind_a_running_completion(sock, eng, 20)  # ~1 s of steps: several polls of the socket
        with sock.makefile("rb") as f:
            status, body = read_response(f)
            assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
            status, body = read_response(f)
            assert status == 200 and json.loads(body)["status"] == "ok"
        assert wait_pool_empty(eng, 2.0)
    assert not [r.getMessage() for r in logged]


BAD = [
    ("invalid json", "/v1/completions", b"{not json", 400),
    ("not an object", "/v1/completions", [1, 2], 400),
    ("missing prompt", "/v1/completions", {"model": NAME}, 400),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400),
    ("wrong type", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("negative max_tokens", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -1}, 400),
    ("huge max_tokens", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 10**9}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("empty prompt", "/v1/completions", {"model": NAME, "prompt": ""}, 400),
    ("over-long prompt", "/v1/completions", {"model": NAME, "prompt": "word " * 400}, 400),
    ("bad stop", "/v1/completions", {"model": NAME, "prompt": "hi", "stop": [1, 2]}, 400),
    ("empty stop string", "/v1/completions", {"model": NAME, "prompt": "hi", "stop": ""}, 400),
    ("temperature < 0", "/v1/completions", {"model": NAME, "prompt": "hi", "temperature": -0.5}, 400),
    ("top_p > 1", "/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 1.5}, 400),
    ("n too large", "/v1/completions", {"model": NAME, "prompt": "hi", "n": 100}, 400),
    ("token out of vocab", "/v1/completions", {"model": NAME, "prompt": [1, 10**7]}, 400),
    ("empty messages", "/v1/chat/completions", {"model": NAME, "messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("message without content", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("unknown route", "/v1/embeddings", {"model": NAME, "input": "x"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_shaped_4xx(server, name, path, body, status):
    url, eng = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err


def test_api_key_is_enforced(server):
    url, _ = server
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_models_health_metrics_tokenize(server, client, tok):
    url, eng = server
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = "O Romeo, Romeo!"
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/tokenize", {"prompt": text}), ("/detokenize", {"tokens": [1]})):  # behind the key too
        assert httpx.post(url + path, json=body).status_code == 401
    t = httpx.post(url + "/tokenize", json={"prompt": text}, headers=auth).json()
    assert t["tokens"] == tok.encode(text)
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}, headers=auth).json()["prompt"] == text
    client.completions.create(model=NAME, prompt=text, max_tokens=2, **GREEDY)
    m = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name in m
    count = float(next(l for l in m.splitlines() if l.startswith("vllm:e2e_request_latency_seconds_count")).split()[-1])
    assert count >= 1


def test_small_requests_stay_on_the_event_loop_and_large_or_grammar_ones_go_to_threads(server, model, tok,
                                                                                       monkeypatch):
    """A small request is parsed, tokenised and queued on the event loop (a hop to a thread and back costs more
    under load: k3.serve.serving.off_loop); a body over INLINE_BODY_BYTES takes all three steps to worker threads,
    a small chat with a response_format its preparation (a grammar's compile); each gets the same tokens."""
    from k3.serve.serving import INLINE_BODY_BYTES
    url, _ = server
    hops, to_thread = [], asyncio.to_thread

    async def counting(fn, *a, **k):
        hops.append(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "?"))
        return await to_thread(fn, *a, **k)
    monkeypatch.setattr(asyncio, "to_thread", counting)
    ids = tok.encode("Now is the winter of our discontent")
    want = reference(model, ids, 6)
    body = {"model": NAME, "prompt": "Now is the winter of our discontent", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def streamed(h, path, content):
        got = []
        with h.stream("POST", path, content=content) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    got += [t for c in json.loads(line[5:])["choices"] for t in c.get("token_ids") or []]
        return got
    with httpx.Client(base_url=url, headers=headers, timeout=30) as h:
        assert streamed(h, "/v1/completions", json.dumps(body)) == want and hops == []
        padded = json.dumps(body) + " " * INLINE_BODY_BYTES  # the same request, a body past the limit
        assert streamed(h, "/v1/completions", padded) == want
        assert hops == ["parse_body", "prepare", "submit_all"], hops
        hops.clear()
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Say a word."}], "max_tokens": 4,
                "response_format": {"type": "json_object"}, "stream": True, "return_token_ids": True}
        assert len(streamed(h, "/v1/chat/completions", json.dumps(chat))) >= 1 and hops == ["prepare"], hops
