"""The load generator's own ceiling: what `k3 bench serve`'s clients can read from a server that costs nothing.

A serving benchmark measures the server only while its clients keep up. Here a stand-in server streams every
request's tokens at a fixed pace (k3-shaped completion chunks with `token_ids`, then the usage chunk), so the ideal
is known: streams x 1000 / pace tokens/s, and a first token as soon as a request arrives. Each client runs in a
process of its own against it, as `k3 bench serve` runs its load (64 streams, 4 requests each by default):
  k3                 k3.serve.bench.run_load (one aiohttp session since session 24; in session 23 one httpx client
                     of one connection per stream)
  httpx shared       one httpx.AsyncClient for every stream (k3's load generator before session 23)
  aiohttp (peer)     one aiohttp session, the client library of vLLM's `vllm bench serve`
Run: python benchmarks/bench_load_client.py [--streams 64] [--requests 256] [--output-len 128] [--pace-ms 4 0]
(`--client` is the child processes' entry.)
"""
import argparse
import asyncio
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def paced_app(pace_ms: float):
    """An ASGI app answering POST /v1/completions with max_tokens streamed tokens, one every pace_ms."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        n = (await request.json())["max_tokens"]

        async def events():
            for i in range(n):
                chunk = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "text": " thou", "token_ids": [100 + i], "logprobs": None,
                                      "finish_reason": None if i + 1 < n else "length"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(pace_ms / 1e3)
            usage = {"prompt_tokens": 256, "completion_tokens": n, "total_tokens": 256 + n}
            yield f"data: {json.dumps({'id': 'cmpl-0', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


async def minimal_client(kind: str, url: str, requests: int, streams: int, output_len: int) -> dict:
    """The two other clients: each request streamed and its token chunks counted and timed, as run_load does."""
    sem, ttfts, tokens = asyncio.Semaphore(streams), [], [0]
    body = {"model": "m", "prompt": "thou " * 256, "max_tokens": output_len, "stream": True}

    async def lines_httpx(client):
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                yield line

    async def lines_aiohttp(session):
        async with session.post(url + "/v1/completions", json=body) as r:
            async for raw in r.content:
                yield raw.decode().rstrip("\n")

    async def one(client, lines):
        async with sem:
            t0, first = time.perf_counter(), None
            async for line in lines(client):
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"]:
                        tokens[0] += 1
                        first = first or time.perf_counter()
            ttfts.append(first - t0)

    t0 = time.perf_counter()
    if kind == "httpx":
        import httpx
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
            await asyncio.gather(*(one(client, lines_httpx) for _ in range(requests)))
    else:
        import aiohttp
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*(one(session, lines_aiohttp) for _ in range(requests)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {"out_tok_per_s": tokens[0] / wall, "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))], "tokens": tokens[0]}


def run_client(kind: str, url: str, a) -> dict:
    """One client row in a process of its own; its CPU seconds from the children's rusage."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if kind == "k3":
        from k3.serve.bench import run_load_in_own_process
        r = run_load_in_own_process(url, "m", "random", a.requests, a.streams, None, 256, a.output_len, 1, None, 0)
        row = {"out_tok_per_s": r["out_tok_per_s"], "ttft_mean_ms": r["ttft_ms"]["mean"],
               "ttft_p99_ms": r["ttft_ms"]["p99"], "tokens": round(r["out_tok_per_s"] * r["wall_s"])}
    else:
        cmd = [sys.executable, __file__, "--client", kind, "--url", url, "--streams", str(a.streams),
               "--requests", str(a.requests), "--output-len", str(a.output_len)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return row


def load_arguments(doc: str, paces: list[float]) -> argparse.ArgumentParser:
    """The options of a paced load (this benchmark's and bench_serve_frontend's): streams, requests, tokens, paces."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--pace-ms", type=float, nargs="+", default=paces)
    return ap


def main():
    ap = load_arguments(__doc__, [4.0, 0.0])
    ap.add_argument("--client", choices=("httpx", "aiohttp"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        print(json.dumps(asyncio.run(minimal_client(a.client, a.url, a.requests, a.streams, a.output_len))))
        return
    from k3.serve.local_server import local_server
    print(f"{a.streams} streams, {a.requests} requests of {a.output_len} tokens; each client in its own process")
    print("| server pace | client | out tok/s | ideal tok/s | TTFT mean / p99 ms | client CPU s |")
    print("|---|---|---:|---:|---|---:|")
    for pace in a.pace_ms:
        ideal = a.streams * 1e3 / pace if pace else float("inf")
        with local_server(paced_app(pace)) as url:
            for kind, name in (("k3", "k3"), ("httpx", "httpx shared (k3 before session 23)"), ("aiohttp", "aiohttp (peer)")):
                if importlib.util.find_spec(kind if kind != "k3" else "aiohttp") is None:
                    print(f"| {pace:g} ms | {name} | not installed | | | |")
                    continue
                r = run_client(kind, url, a)
                assert r["tokens"] == a.requests * a.output_len, r
                print(f"| {pace:g} ms | {name} | {r['out_tok_per_s']:,.0f} | {ideal:,.0f} | "
                      f"{r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['client_cpu_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
