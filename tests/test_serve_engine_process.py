"""The engine in a process of its own (k3.serve.engine_process), live behind the real server and the real openai
client: its tokens, text and logprobs must equal the in-process engine's and the model's own `generate`; the
server's counters reach the engine's /metrics; a client that leaves frees its blocks in the other process; a bad
request is refused before anything crosses; and the failures are attacked: the engine process killed mid-stream,
a build that fails, and the server process killed (its engine must not outlive it)."""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest
import torch

from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine
from k3.serve.api import create_app
from k3.serve.bench import make_model
from k3.serve.engine_process import EngineProcess, build_engine
from k3.serve.local_server import local_server
from k3.serve.sampling import SamplingParams

NAME, SEED = "k3-tiny", 3
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def config() -> EngineConfig:
    return EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4, max_batch_tokens=256, max_num_seqs=32,
                        max_model_len=200)


def process(tok, maker=functools.partial(make_model, None, "tiny", SEED)) -> EngineProcess:
    return EngineProcess(functools.partial(build_engine, maker, tok, config()))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


@pytest.fixture(scope="module")
def model():
    return make_model(None, "tiny", SEED)  # the same weights the engine process makes for itself


@pytest.fixture(scope="module")
def server(tok):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # (the engine process takes this count too)
    proc = process(tok).start()
    with local_server(create_app(proc, tok, NAME), as_k3_serve=True) as url:
        yield url, proc
    torch.set_num_threads(n)
    assert not proc._proc.is_alive()  # the app's shutdown stopped it


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_pool_empty(proc, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.call("pool_usage") == (0, 0, False):
            return True
        time.sleep(0.05)
    return False


def test_tokens_text_and_logprobs_equal_the_in_process_engine(client, server, model, tok):
    prompts = ["To be, or not to be", "Once more unto the breach", "Now is the winter"]
    local = LLMEngine(model, tok, config())
    ids = [local.add_request(tok.encode(p), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=2))
           for p in prompts]
    lps = {i: [] for i in ids}
    final = {}
    while local.has_unfinished():
        for out in local.step():
            lps[out.request_id] += out.new_logprobs
            if out.finished:
                final[out.request_id] = out
    want = [final[i] for i in ids]
    for p, w, i in zip(prompts, want, ids):
        ref = model.generate(torch.tensor([tok.encode(p)]), max_new_tokens=9)[0, len(tok.encode(p)):].tolist()
        assert list(w.output_ids) == ref
        r = client.completions.create(model=NAME, prompt=p, max_tokens=9, logprobs=2, **GREEDY)
        c = r.choices[0]
        assert c.token_ids == ref and c.text == w.text and c.finish_reason == "length"
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in lps[i]], abs=1e-5)
        tops = [sorted(t.values(), reverse=True) for t in c.logprobs.top_logprobs]
        assert tops == [pytest.approx([v for _, v in lp.top], abs=1e-5) for lp in lps[i]]
        streamed = list(client.completions.create(model=NAME, prompt=p, max_tokens=9, stream=True, **GREEDY))
        assert "".join(x.choices[0].text for x in streamed if x.choices) == w.text
        assert sum((x.choices[0].token_ids for x in streamed if x.choices), []) == ref
    # a stop string: the cut text is the engine's (sent whole with the last output), as in one process
    first = want[0].text
    stop = first[len(first) // 2:len(first) // 2 + 3]
    assert stop.strip()
    cut = local.generate([tok.encode(prompts[0])], SamplingParams(max_tokens=9, temperature=0, stop=[stop]))[0]
    r = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=9, stop=[stop], temperature=0)
    assert r.choices[0].text == cut.text and r.choices[0].finish_reason == cut.finish_reason == "stop"
    assert wait_pool_empty(server[1])
    local.close()


def test_counters_reach_the_engines_metrics(client, server):
    url, proc = server

    def counts() -> tuple[float, float]:
        body = httpx.get(url + "/metrics").text
        n = re.search(r'^vllm:request_params_n_count\{[^}]*\} (\S+)$', body, re.M)
        gen = re.search(r'^vllm:generation_tokens_total\{[^}]*\} (\S+)$', body, re.M)
        return float(n.group(1)), float(gen.group(1))
    n0, gen0 = counts()
    client.completions.create(model=NAME, prompt=["Hark", "Alas"], max_tokens=5, n=2, **GREEDY)
    n1, gen1 = counts()
    assert n1 - n0 == 2  # the server's per-prompt count, sent over to the engine's Metrics
    assert gen1 - gen0 == 2 * 2 * 5  # the engine's own


def test_the_engine_process_freezes_its_start_up_objects(server):
    """The engine process exempts the model and engine it built from the cyclic collector (k3.serve.gc_freeze: a
    full collection over them stalled the step loop); this test process never froze anything."""
    import gc
    _, proc = server
    assert proc.call("gc_frozen") > 10_000  # torch, the model, the engine
    assert gc.get_freeze_count() == 0


def test_ctrl_c_is_the_servers_to_handle(server):
    """SIGINT (Ctrl-C reaches the whole process group) leaves the engine process serving: the server stops it."""
    os.kill(server[1].pid, signal.SIGINT)
    time.sleep(0.3)
    assert server[1]._proc.is_alive() and server[1].call("pool_usage") == (0, 0, False)


def held_tiny():
    """The tiny model with every forward held 30 ms (a device's step stood in by a sleep): a 150-token request runs
    for 4.5 s or more in the engine's process, however loaded the machine leaves the server's."""
    model = make_model(None, "tiny", SEED)
    forward = model.model.forward

    def held(*args, **kwargs):
        time.sleep(0.03)
        return forward(*args, **kwargs)
    model.model.forward = held
    return model


def test_client_disconnect_frees_the_engine_process_pool(tok):
    """A client that leaves mid-stream: the engine's process aborts its request (150 tokens would take 4.5 s) and its
    pool empties within 2 s. A first event read so late that the request had already ended (a loaded machine) cannot
    show the abort: that stream must then be whole (a slow reader, not an early end), and the test tries again, three
    times at most."""
    proc = process(tok, held_tiny).start()
    body = {"model": NAME, "prompt": "Now is the winter of our discontent", "max_tokens": 150, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with local_server(create_app(proc, tok, NAME)) as url, httpx.Client(timeout=30) as h:
        for attempt in range(3):
            with h.stream("POST", url + "/v1/completions", json=body) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data:"))
                assert json.loads(next(lines)[5:])["choices"]
                if proc.call("pool_usage")[2]:  # running in the other process: leave mid-stream
                    break
                rest = list(lines)
                assert rest[-1] == "data: [DONE]", (attempt, rest[-2:])
                end = json.loads(rest[-2][5:])["choices"][0]["finish_reason"]
                assert end == "length", (attempt, rest[-2:])  # all 150 tokens: not an abort or an error
        else:
            pytest.fail("three times the first event came after the request had ended")
        assert wait_pool_empty(proc, 2)  # aborted there


@pytest.mark.parametrize("prompt,why", [([8192], r"in \[0, 8192\)"), ([5] * 199, "maximum sequence length")])
def test_bad_requests_are_refused_before_they_cross(client, server, prompt, why):
    with pytest.raises(openai.BadRequestError, match=why):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=5)
    assert server[1].call("pool_usage") == (0, 0, False)


def test_engine_process_killed_mid_stream(tok):
    """SIGKILL the engine process while a stream runs: the stream ends with an error event and [DONE] (no hang),
    /health answers 503, and a new request fails at once."""
    proc = process(tok).start()
    with local_server(create_app(proc, tok, NAME)) as url, httpx.Client(base_url=url, timeout=30) as h:
        assert h.get("/health").status_code == 200
        body = {"model": NAME, "prompt": "Friends, Romans", "max_tokens": 150, "stream": True, "ignore_eos": True}
        events = []
        with h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 2:
                        os.kill(proc.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert len(events) < 150
        assert h.get("/health").status_code == 503
        t0 = time.monotonic()
        r = h.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code >= 500 and time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError, match="engine"):
            proc.call("pool_usage")


def test_a_failing_build_is_reported(tok, tmp_path):
    proc = process(tok, functools.partial(make_model, str(tmp_path / "missing"), "tiny", 0))
    with pytest.raises(RuntimeError, match="failed to start"):
        proc.start()
    assert not proc._proc.is_alive()


def test_engine_exits_with_its_server_process(tmp_path):
    """The server's process killed outright (no shutdown runs): its engine process sees the pipe close and exits."""
    script = textwrap.dedent("""
        import functools, sys, time
        from k3.data import Tokenizer
        from k3.serve import EngineConfig
        from k3.serve.bench import make_model
        from k3.serve.engine_process import EngineProcess, build_engine
        if __name__ == "__main__":
            cfg = EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4, max_model_len=200)
            proc = EngineProcess(functools.partial(build_engine, functools.partial(make_model, None, "tiny", 0),
                                                   Tokenizer.from_file(), cfg)).start()
            print(proc.pid, flush=True)
            time.sleep(120)
    """)
    path = tmp_path / "server.py"
    path.write_text(script)
    server = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(server.stdout.readline())
        os.kill(engine_pid, 0)  # alive
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(engine_pid):
            time.sleep(0.1)
        assert not _alive(engine_pid)
    finally:
        server.kill()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_images_cross_to_the_engine_process(vlm, tok):
    """A chat request with an image (its preprocessed tensors cross the pipe): the same answer as the in-process
    engine's, and a bad image is still refused by the server with a 400."""
    from fastapi.testclient import TestClient
    from test_vision_serve import chat_body, data_url, png
    from tiny_vlm import make_tiny_vlm

    def answer(engine) -> tuple[dict, int]:
        with TestClient(create_app(engine, tok, "k3")) as client:
            ok = client.post("/v1/chat/completions", json={**chat_body(data_url(png(5))), "max_tokens": 6})
            bad = client.post("/v1/chat/completions", json=chat_body(data_url(b"not a png")))
            assert ok.status_code == 200, ok.text
            return ({k: ok.json()[k] for k in ("choices", "usage")}, bad.status_code)
    local = answer(LLMEngine(vlm, tok, config()))
    proc = EngineProcess(functools.partial(build_engine, make_tiny_vlm, tok, config())).start()
    assert proc.vision_config is not None
    assert answer(proc) == local and local[1] == 400
    assert not proc._proc.is_alive()


def test_k3_serve_runs_its_engine_in_a_child_and_takes_it_down_on_sigterm(tmp_path):
    """The CLI as a user starts it: `k3 serve` answers as the model's own `generate`, from an engine process that
    is its child; SIGTERM (what process managers send) stops the server and the engine process with it."""
    from live_serve import k3_serve, save_tiny_model
    from test_serve_distributed import _serving_pid, children_of

    model = save_tiny_model(tmp_path / "model")
    tok = Tokenizer.from_file()
    with k3_serve(tmp_path / "model", "k", "m", tmp_path / "serve.log") as url:
        server = _serving_pid(url)
        engines = [p for p in children_of(server) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(engines) == 1
        ids = tok.encode("Friends, Romans")
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                       json={"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
        want = model.generate(torch.tensor([ids]), max_new_tokens=6)[0, len(ids):].tolist()
        assert r.json()["choices"][0]["token_ids"] == want
    deadline = time.monotonic() + 15  # k3_serve's exit sent SIGTERM and waited for the server
    while time.monotonic() < deadline and _alive(engines[0]):
        time.sleep(0.1)
    assert not _alive(engines[0])
