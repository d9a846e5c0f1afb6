"""`k3 serve` against hostile clients left open by issue 19: request heads dripped a byte at a time (slowloris) or
never sent, connection floods (--limit-concurrency), and prompt-logprob requests whose host memory would grow
with prompt length × top-k. The connection tests drive a real `k3 serve` process over raw sockets."""
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from k3.data import Tokenizer
from k3.serve import SamplingParams
from k3.serve.api import create_app
from k3.serve.local_server import local_server
from k3.serve.sampling import MAX_PROMPT_LOGPROB_ENTRIES
from live_serve import k3_serve, save_tiny_model
from test_prompt_logprobs import plain_logprobs
from test_serve_engine import assert_pool_empty, engine, model, prompt  # noqa: F401

KEY, NAME = "hostile-key", "k3-hostile"
HEADER_TIMEOUT = 2.0
LIMIT = 8


# ---- connections: a real server process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    save_tiny_model(d / "model")
    with k3_serve(d / "model", KEY, NAME, d / "serve.log", "--header-timeout", str(HEADER_TIMEOUT),
                  "--limit-concurrency", str(LIMIT)) as url:
        yield url


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _drip(sock: socket.socket, data: bytes, every_s: float, give_up_s: float) -> tuple[float | None, bytes]:
    """Send `data` (cycled) one byte every `every_s` until the server closes the connection → (seconds until the
    close or None if it was still open after give_up_s, what the server sent)."""
    start, got, i = time.monotonic(), b"", 0
    sock.setblocking(False)
    while time.monotonic() - start < give_up_s:
        try:
            sock.send(data[i % len(data):i % len(data) + 1])
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start, got
        i += 1
        if select.select([sock], [], [], every_s)[0]:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                return time.monotonic() - start, got
            if not chunk:
                return time.monotonic() - start, got
            got += chunk
    return None, got


HEAD = b"POST /tokenize HTTP/1.1\r\nHost: k3\r\n" + b"X-Drip: slowly\r\n" * 1000  # longer than the drip can send


def test_a_dripped_request_head_is_cut_off_within_the_header_timeout_while_health_answers(live):
    result = {}

    def attack():
        with socket.create_connection(_address(live)) as s:
            result["closed_after"], result["got"] = _drip(s, HEAD, 0.1, give_up_s=4 * HEADER_TIMEOUT)
    attacker = threading.Thread(target=attack)
    attacker.start()
    answers = []
    while attacker.is_alive():
        answers.append(httpx.get(f"{live}/health", timeout=2).status_code)  # another client, meanwhile
        time.sleep(0.3)
    attacker.join()
    assert result["closed_after"] is not None, "the dripping connection was still open"
    assert HEADER_TIMEOUT - 0.3 <= result["closed_after"] <= HEADER_TIMEOUT + 1.5
    assert result["got"].startswith(b"HTTP/1.1 408 ")
    assert len(answers) >= 3 and set(answers) == {200}


def test_a_connection_that_sends_nothing_is_closed(live):
    with socket.create_connection(_address(live)) as s:
        s.settimeout(4 * HEADER_TIMEOUT)
        start = time.monotonic()
        assert s.recv(100) == b""  # closed, silently: it had asked nothing
        assert HEADER_TIMEOUT - 0.3 <= time.monotonic() - start <= HEADER_TIMEOUT + 1.5


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_a_slow_but_finished_head_and_a_slow_body_are_served_then_the_next_head_gets_its_own_deadline(live):
    body = b'{"prompt": "hello"}'
    head = (f"POST /tokenize HTTP/1.1\r\nHost: k3\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(_address(live)) as s:
        for i in range(0, len(head), len(head) // 4 + 1):  # the head in pieces, within the deadline
            s.sendall(head[i:i + len(head) // 4 + 1])
            time.sleep(HEADER_TIMEOUT / 8)
        time.sleep(HEADER_TIMEOUT + 1)  # the body comes later than the head deadline: the head had arrived
        s.sendall(body)
        response = _read_response(s)
        assert response.startswith(b"HTTP/1.1 200 ") and b'"count"' in response
        # keep-alive: the same connection now drips the next request's head, which has a deadline of its own
        closed_after, got = _drip(s, HEAD, 0.1, give_up_s=4 * HEADER_TIMEOUT)
    assert closed_after is not None and closed_after <= HEADER_TIMEOUT + 1.5
    assert got.startswith(b"HTTP/1.1 408 ")


def test_connections_past_the_concurrency_limit_get_503_until_they_go(live):
    assert httpx.get(f"{live}/health", timeout=2).status_code == 200
    held = [socket.create_connection(_address(live)) for _ in range(LIMIT)]
    try:
        deadline, status = time.monotonic() + HEADER_TIMEOUT / 2, None
        while time.monotonic() < deadline and status != 503:  # until the server has accepted them all
            status = httpx.get(f"{live}/health", timeout=2).status_code
        assert status == 503
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and status != 200:
        status = httpx.get(f"{live}/health", timeout=2).status_code
        time.sleep(0.05)
    assert status == 200


@pytest.mark.parametrize("soft, hard, limit, soft_after", [
    (300, 300, 300 - 256, 300),     # the hard cap binds: the limit shrinks to what fits beside the server's files
    (300, 1300, 1024, 1024 + 256),  # the soft limit is raised so that 1024 sockets fit
])
def test_the_connection_limit_fits_the_open_files_limit(soft, hard, limit, soft_after):
    code = ("import resource; from k3.serve.head_timeout import fit_connection_limit; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            "print(fit_connection_limit(1024), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(limit), str(soft_after)]


# ---- prompt logprobs: a bound on what one request keeps ----------------------------------------------------
BIG_MEMORY = dict(memory_bytes=64 << 20, block_size=64, match_unit=16)  # holds a ~146K-token prompt


def test_the_engine_refuses_prompt_logprobs_past_the_bound_before_anything_is_queued(model):
    eng = engine(model, **BIG_MEMORY)
    attack = prompt(7, 100_000)
    assert len(attack) + 1 <= eng.max_model_len  # the prompt alone would be served
    with pytest.raises(ValueError, match=r"^prompt_logprobs 20 over 100000 prompt tokens .*at most 1048576"):
        eng.add_request(attack, SamplingParams(max_tokens=0, prompt_logprobs=20))
    assert not eng.seqs and not eng.has_unfinished()
    assert_pool_empty(eng)
    eng.check_request(attack, SamplingParams(max_tokens=0, prompt_logprobs=0))  # 100K entries: within
    # the edge: tokens × (k+1) equal to the bound passes, one token more does not
    k = 7
    edge = prompt(8, MAX_PROMPT_LOGPROB_ENTRIES // (k + 1) + 1)
    eng.check_request(edge[:-1], SamplingParams(max_tokens=0, prompt_logprobs=k))
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        eng.check_request(edge, SamplingParams(max_tokens=0, prompt_logprobs=k))


@pytest.fixture(scope="module")
def api(model):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = engine(model, **BIG_MEMORY)
    with local_server(create_app(eng, Tokenizer.from_file(), NAME)) as url:
        yield url, eng
    torch.set_num_threads(n)


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": NAME, "max_tokens": 0, **body}, timeout=60)


@pytest.mark.parametrize("body, param", [
    (dict(prompt=prompt(9, 100_000), prompt_logprobs=20), "prompt_logprobs"),
    (dict(prompt=prompt(10, 60_000), echo=True, logprobs=20), "logprobs"),  # OpenAI's spelling of the same
    (dict(prompt=[prompt(11, 30_000), prompt(12, 30_000)], prompt_logprobs=20), "prompt_logprobs"),  # 630K each
    (dict(prompt=prompt(13, 30_000), prompt_logprobs=20, n=2), "prompt_logprobs"),  # each choice scores its prompt
])
def test_http_refuses_prompt_logprobs_past_the_bound_with_a_400_naming_the_field(api, body, param):
    url, eng = api
    r = _complete(url, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param) and "1048576" in err["message"]
    assert not eng.seqs and not eng.has_unfinished()
    assert_pool_empty(eng)


def test_http_prompt_logprobs_under_the_bound_are_served(api, model):
    url, eng = api
    ids = prompt(14, 30)
    r = _complete(url, prompt=ids, prompt_logprobs=3)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = plain_logprobs(model, ids)
    assert len(got) == len(ids) and got[0] is None
    for t, entry in enumerate(got[1:], start=1):
        assert entry[str(ids[t])]["logprob"] == pytest.approx(float(ref[t - 1, ids[t]]), abs=1e-4)
        assert {int(i) for i in entry} >= set(ref[t - 1].topk(3).indices.tolist())


def test_a_body_that_stops_arriving_gets_a_408_after_the_body_timeout_and_nothing_is_queued(model):
    """A request whose head promises more body than ever comes: a 408 once body_timeout_s has passed (not sooner,
    not never), and the engine never sees it."""
    eng = engine(model)
    body = b'{"model": "%s", "prompt": "hello", "max_tokens": 3}' % NAME.encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 50}\r\n\r\n").encode()
    with local_server(create_app(eng, Tokenizer.from_file(), NAME, body_timeout_s=1.0)) as url:
        host, port = url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port))) as s:
            t0 = time.monotonic()
            s.sendall(head + body)  # 50 bytes short
            response = _read_response(s)
            waited = time.monotonic() - t0
    assert response.startswith(b"HTTP/1.1 408 ") and b"longer than 1 s" in response, response[:300]
    assert 0.9 <= waited <= 5.0, waited
    assert not eng.has_unfinished()
    assert_pool_empty(eng)
