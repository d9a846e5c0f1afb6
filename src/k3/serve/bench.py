"""`k3 bench serve`: a load generator in the spirit of `vllm bench serve`. Streams requests over HTTP (max
concurrency or a Poisson request rate), from random prompts or a multi-turn shared-prefix chat dataset, and
reports TTFT, TPOT, ITL, e2e latency (mean/median/p99), throughput and prefix-cache hit rate; next to a
static-batch baseline (the model's own `generate` over fixed batches). Every run also checks itself: no failed
request, exactly `output_len` tokens each (EOS is ignored, so random weights give full-length outputs), and the
engine's pool empty afterwards."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from k3.serve import gc_freeze
from k3.serve.local_server import local_server
from k3.serve.metrics import StepLog

DATASETS = ("random", "multiturn")  # shared-nothing random prompts; multi-turn chats over a shared prefix


@dataclass
class RequestResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = False


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: {"mean": 1e3 * statistics.fmean(xs) if xs else float("nan"),
                     "median": 1e3 * statistics.median(xs) if xs else float("nan"), "p99": 1e3 * _pct(xs, 99)}
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
            "req_per_s": len(ok) / wall, "out_tok_per_s": sum(r.output_tokens for r in ok) / wall,
            "total_tok_per_s": (prompt + sum(r.output_tokens for r in ok)) / wall,
            "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms(tpot), "itl_ms": ms([x for r in ok for x in r.itls]),
            "e2e_ms": ms([r.e2e for r in ok]),
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0}


async def _stream(session, url: str, path: str, body: dict, headers: dict) -> tuple[RequestResult, str]:
    """One streamed request → (timings, generated text). Tokens are timed by their ids (`return_token_ids`):
    a token whose text is empty or held back still arrives in its own chunk, so TTFT and ITL are per token."""
    res, text = RequestResult(), ""
    t0 = time.perf_counter()
    last = None
    async with session.post(url + path, json={**body, "stream": True, "return_token_ids": True,
                                              "stream_options": {"include_usage": True}}, headers=headers) as r:
        if r.status != 200:
            await r.read()
            return res, ""
        async for raw in r.content:  # one line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                u = obj["usage"]
                res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                continue
            ch = obj["choices"][0]
            delta = ch.get("delta", {})
            text += ch.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            if not ch.get("token_ids"):
                continue
            now = time.perf_counter()
            if last is None:
                res.ttft = now - t0
            else:
                res.itls.append(now - last)
            last = now
    res.e2e = time.perf_counter() - t0
    res.ok = res.output_tokens > 0
    return res, text


def random_prompts(n: int, input_len: int, vocab_words: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocab_words) for _ in range(input_len)) for _ in range(n)]


def _session(concurrency: int | None):
    """The load's HTTP client: one aiohttp session (the client library of vLLM's `vllm bench serve`), keeping at
    most `concurrency` connections alive for reuse. httpx cost the load generator its own ceiling at 64 streams
    (benchmarks/bench_load_client.py, against a server that streams a token every 4 ms, ideal 16,000 tok/s): one
    shared client's pool rescans every connection per request (2-core VM: 9,844 tok/s, TTFT 132 ms), and even a
    client of one connection per stream parsed each chunk through anyio's layers (the H200's host: 11,264 tok/s
    and TTFT 77 ms, where aiohttp read 11,869 and 19 ms). Lines up to 1 MiB (long logprob chunks)."""
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency or 0), read_bufsize=1 << 20,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=600))


async def run_load(url: str, model: str, dataset: str, num_prompts: int, concurrency: int | None,
                   request_rate: float | None, input_len: int, output_len: int, turns: int, api_key: str | None,
                   seed: int = 0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    words = ("thou art the king of all that the sea and sky would hold in a summer day when love is "
             "young and night is gone").split()
    rng = random.Random(seed)
    results: list[RequestResult] = []
    common = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}

    sem = asyncio.Semaphore(concurrency or 10**9)
    async with _session(concurrency) as session:
        async def one_completion(prompt):
            async with sem:
                r, _ = await _stream(session, url, "/v1/completions", {**common, "prompt": prompt}, headers)
                results.append(r)

        async def one_session(i):  # turns share the growing conversation as their prefix
            system = "You are a courtly poet. " + " ".join(words[(i + j) % len(words)] for j in range(input_len))
            messages = [{"role": "system", "content": system}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"Verse {t} about {words[(i * 7 + t) % len(words)]}."})
                async with sem:
                    r, text = await _stream(session, url, "/v1/chat/completions", {**common, "messages": messages},
                                            headers)
                results.append(r)
                messages.append({"role": "assistant", "content": "", "reasoning_content": text})

        if dataset == "random":
            jobs = [one_completion(p) for p in random_prompts(num_prompts, input_len, words, seed)]
        elif dataset == "multiturn":
            jobs = [one_session(i) for i in range(max(1, num_prompts // turns))]
        else:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
        t0 = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(job))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    out = summarize(results, wall)
    out["start_s"] = t0  # (perf_counter: the host's monotonic clock, which the engine's process reads too)
    out["wrong_length"] = sum(r.output_tokens != output_len for r in results if r.ok)
    return out


def run_load_in_own_process(*args) -> dict:
    """`run_load(*args)` in a separate Python process, as `vllm bench serve` runs apart from its server: in the
    server's own process, parsing 64 clients' SSE streams would take the GIL from the engine and the HTTP layer
    and show up as server latency. A fresh interpreter (not multiprocessing), so no caller needs a __main__
    guard."""
    code = ("import asyncio, json, sys\nfrom k3.serve.bench import run_load\nfrom k3.serve.gc_freeze import freeze\n"
            "freeze()\nprint(json.dumps(asyncio.run(run_load(*json.load(sys.stdin)))))")
    k3_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [k3_root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(args), capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"the load generator failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def requests_per_level(concurrency: int | None, num_prompts: int, per_concurrency: int) -> int:
    """Requests at one concurrency level: at least `num_prompts`, and `per_concurrency` per concurrent slot, so
    every level runs the same number of waves (multi-turn: per_concurrency / turns conversations per slot)."""
    return num_prompts if concurrency is None else max(num_prompts, per_concurrency * concurrency)


def make_model(model_dir: str | None, preset: str, seed: int, device: str = "cpu", dtype: str = "float32"):
    """The benchmark's model: a checkpoint directory's, or the preset's initialised from seed (on device, the same
    weights every time: the engine's process makes its own copy this way, `k3.serve.engine_process`)."""
    from k3 import K3Config, K3ForCausalLM
    if model_dir:
        model = K3ForCausalLM.from_pretrained(model_dir, device=device)
    else:
        with torch.device(device):  # built where it runs: no host copy of the weights first
            model = K3ForCausalLM(K3Config.preset(preset), init=False)  # the seeded init below is the one
        model.reset_parameters(seed=seed)
    model.eval()
    return model if dtype == "float32" else model.to(getattr(torch, dtype))


def static_batch_baseline(model, tokenizer, num_prompts: int, batch_size: int, input_len: int, output_len: int,
                          seed: int = 0, warmup: bool = False) -> dict:
    """What one writes without an engine: `generate` over fixed batches of equal-length prompts, on the model's
    device (no EOS: every row must get exactly output_len tokens, else it is listed in `problems`).
    warmup: one untimed batch of the timed shape first, all output_len tokens (kernel autotuning and compiles
    for this batch size and every cache length the timed batches reach)."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)  # drawn on the host: the same prompts on every device
    lo = len(tokenizer.special_tokens)
    prompts = torch.randint(lo, model.config.vocab_size, (num_prompts, input_len), generator=g).to(device)
    lat, wrong = [], 0
    if warmup:
        model.generate(prompts[:batch_size], max_new_tokens=output_len, eos_token_id=None)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, num_prompts, batch_size):
        batch = prompts[i:i + batch_size]
        b0 = time.perf_counter()
        out = model.generate(batch, max_new_tokens=output_len, eos_token_id=None)  # exactly output_len tokens a row
        _sync(device)  # CUDA runs ahead of the host: time the work, not its launch
        lat += [time.perf_counter() - b0] * len(batch)
        wrong += len(batch) if out.shape != (len(batch), input_len + output_len) else 0
    wall = time.perf_counter() - t0
    res = [RequestResult(ttft=float("nan"), e2e=l, prompt_tokens=input_len, output_tokens=output_len, ok=True)
           for l in lat]
    out = summarize(res, wall)
    out["ttft_ms"] = out["tpot_ms"] = out["itl_ms"] = {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    out["wrong_length"] = wrong
    out["problems"] = [f"{wrong} rows without exactly {output_len} output tokens"] if wrong else []
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(model, tokenizer, engine_config, dataset: str, num_prompts: int, concurrency: int | None,
               request_rate: float | None, input_len: int, output_len: int, turns: int, seed: int = 0,
               on_start=None, warmup: bool = False, make_model=None, profile_top: int = 0) -> dict:
    """One load run against a fresh engine (so a cold prefix cache) behind an in-process server, loaded by
    clients in a process of their own → the summary, plus `problems`: failed requests, outputs of the wrong
    length, a pool not empty afterwards.
    on_start(engine): called once the engine exists (e.g. to print its capacity).
    make_model: a picklable maker of `model` (`make_model`): the engine then runs in a process of its own, which
    makes its model with it (`k3.serve.engine_process`, as `k3 serve` runs); None: on a thread beside the server.
    warmup: first the engine's own warm-up (`LLMEngine.warm_up`: every graph, as `k3 serve` starts) and the same
    load untimed, other prompts at the same concurrency and lengths, so that the timed run does not pay the
    engine's first uses (graph captures, kernel autotuning). `graphs_first_used` counts the decode-graph keys and
    prefill-graph buckets first used while timed (each a capture on CUDA): above 0, the warm-up missed one and
    the timed figures include its capture. `engine`: where the timed run's time went (`StepLog.summary`).
    profile_top > 0: the timed run's engine steps also run under cProfile (slower: the figures are not comparable
    with an unprofiled row) and `profile` holds pstats' tables of the top functions."""
    import functools

    from k3.serve.api import create_app
    from k3.serve.engine import LLMEngine
    from k3.serve.engine_process import EngineProcess, build_engine, inspect

    if make_model is not None:
        engine = EngineProcess(functools.partial(build_engine, make_model, tokenizer, engine_config), warm_up=warmup)
        engine.start()
        ask = engine.call
    else:
        engine = LLMEngine(model, tokenizer, engine_config)
        ask = functools.partial(inspect, engine)
    try:
        if on_start is not None:
            on_start(engine)
        if warmup and make_model is None:  # every graph now (as `k3 serve` starts), then the load itself for the rest
            engine.warm_up()
        with local_server(create_app(engine, tokenizer, "k3"), as_k3_serve=True) as url:  # as `k3 serve` runs it
            if warmup and concurrency:  # other random prompts (another seed): nothing for the timed run to hit
                run_load_in_own_process(url, "k3", dataset, num_prompts, concurrency, request_rate, input_len,
                                        output_len, turns, None, seed + 104729)
            used = ask("graph_keys")
            ask("trace")
            if profile_top:
                ask("profile")
            with gc_freeze.frozen():  # this process serves the HTTP side (k3.serve.gc_freeze)
                s = run_load_in_own_process(url, "k3", dataset, num_prompts, concurrency, request_rate, input_len,
                                            output_len, turns, None, seed)
            s["engine"] = ask("trace_summary", s["wall_s"], s.pop("start_s"))
            if profile_top:
                s["profile"] = ask("profile_summary", profile_top)
            s["graph_keys"] = ask("graph_keys")
            s["graphs_first_used"] = s["graph_keys"] - used
            blocks, slots, unfinished = ask("pool_usage")
        s["problems"] = [msg for bad, msg in (
            (s["failed"], f"{s['failed']} failed requests"),
            (s["wrong_length"], f"{s['wrong_length']} requests without exactly {output_len} output tokens"),
            (blocks or slots or unfinished,
             f"pool not empty afterwards ({blocks} blocks, {slots} slots held)")) if bad]
        return s
    finally:  # the next run allocates a pool of its own: free this one's device memory first
        if make_model is None:
            engine.close()
        else:
            engine.shutdown()  # (the server's lifespan has stopped it already: the process is gone)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def format_engine_summary(e: dict) -> str:
    """One line from `StepLog.summary`: where the engine's time went in a timed run."""
    kinds = ", ".join(f"{e[k]['steps']} {k} steps of {e[k]['rows']:.0f} rows / {e[k]['tokens']:.0f} tokens every "
                      f"{e[k]['period_ms']:.1f} ms ({e[k]['overlapped']} overlapped)" for k in ("decode", "prompt"))
    slow = ", ".join(f"{x['ms']:.0f}" for x in e["slowest"])
    phases = ", ".join(f"{k} {v:.0f}" for k, v in e.get("engine_ms", {}).items())
    return (f"engine: intake {e['intake_s']:.2f} s, stepping {e['step_s']:.2f} s, emitting {e['emit_s']:.2f} s, "
            f"idle {e['idle_s']:.2f} s; {kinds}; slowest periods {slow} ms"
            + (f"; per request from its arrival at the engine (ms): {phases}" if phases else ""))


def format_table(rows: list[tuple[str, dict]]) -> str:
    head = ("| run | req/s | out tok/s | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms | ITL mean/med/p99 ms "
            "| e2e mean/med/p99 ms | hit rate |")
    lines = [head, "|" + "---|" * 8]
    f = lambda d: "/".join("-" if d[k] != d[k] else f"{d[k]:.0f}" for k in ("mean", "median", "p99"))
    for name, s in rows:
        lines.append(f"| {name} | {s['req_per_s']:.2f} | {s['out_tok_per_s']:.1f} | {f(s['ttft_ms'])} | "
                     f"{f(s['tpot_ms'])} | {f(s['itl_ms'])} | {f(s['e2e_ms'])} | {s['hit_rate']:.1%} |")
    return "\n".join(lines)
