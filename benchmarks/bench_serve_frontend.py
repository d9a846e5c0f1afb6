"""The HTTP front-end's own ceiling: what `k3 serve` delivers from an engine that costs nothing.

`k3 bench serve` compares the engine behind HTTP with a static batch on the same card; whatever the server
process spends per token (reading the engine's pipe, rendering and writing each SSE chunk, parsing and
tokenising requests) shows up there as engine time. Here the real server (`create_app` over `EngineProcess`, the
engine in a process of its own, as `k3 serve` runs) drives a stand-in engine that, every `pace` ms, gives each
running request one token (its first one tick after it arrives, as a prefill would): the ideal is streams x 1000 /
pace tokens/s, and a first token one or two ticks after a request arrives. Beside it, in the same run, the
floor of the stack k3 serves with: a bare Starlette app streaming the same chunks at the same pace
(`bench_load_client.paced_app`). Each client runs in a process of its own (`bench_load_client.run_client`). A
second table splits a k3 request's first-token wait: the client's TTFT, the server's (from the request's arrival at
the app to its response head and to its first token's chunk, `FirstChunks`) and the stand-in engine's.
Run: python benchmarks/bench_serve_frontend.py [--streams 64] [--requests 256] [--output-len 128] [--pace-ms 4 2]
       [--profile N]   (then one more run of the k3 server under cProfile, aiohttp's load: its top N functions;
                        profiling doubles the server's CPU, so its figures are not in the table)
"""
import cProfile
import functools
import io
import json
import os
import pstats
import resource
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from bench_load_client import load_arguments, paced_app, run_client  # noqa: E402

from k3.serve.gc_freeze import frozen  # noqa: E402


class PacedEngine:
    """The faces of LLMEngine that EngineThread and the engine process use, over no model: every `pace_s`, one
    token for each running request, until its max_tokens."""
    idle_step_s = None
    profiler = step_log = vision_config = None

    def __init__(self, pace_s: float, vocab_size: int, waits_path: str | None = None, max_model_len: int = 1 << 16):
        from k3.serve.engine import RequestLimits
        self.pace_s, self.limits = pace_s, RequestLimits(vocab_size, max_model_len, None)
        self.running: dict[str, list] = {}  # rid -> [prompt tokens, max_tokens, ids so far, arrival]
        self.waits: list[float] = []  # per request: its arrival here to its first token handed over
        self.waits_path = waits_path  # written at close (the engine process's end)
        self.next_tick = 0.0
        self.metrics = type("NoMetrics", (), {"__getattr__": lambda self, name: lambda *a, **k: None})()

    def describe_capacity(self) -> str:
        return f"a stand-in engine: a token per running request every {self.pace_s * 1e3:g} ms"

    def warm_up(self, *args) -> int:
        return 0

    def check_request(self, prompt, params, images=None) -> None:
        self.limits.check(prompt, params, images)

    def add_request(self, prompt, params, rid, *rest) -> None:
        self.running[rid] = [len(prompt), params.max_tokens, [], time.perf_counter()]

    def abort(self, rid: str) -> bool:
        return self.running.pop(rid, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self):
        from k3.serve.sequence import CacheReport, RequestOutput
        now = time.perf_counter()
        if self.next_tick > now:
            time.sleep(self.next_tick - now)
        self.next_tick = max(self.next_tick, now) + self.pace_s
        outputs = []
        for rid, (prompt_tokens, max_tokens, ids, arrival) in list(self.running.items()):
            if not ids:
                self.waits.append(time.perf_counter() - arrival)
            ids.append(100 + len(ids) % 1000)
            last = len(ids) == max_tokens
            if last:
                del self.running[rid]
            outputs.append(RequestOutput(rid, ids[-1:], " thou", [], ids, " thou" * len(ids), last,
                                         "length" if last else None, prompt_tokens, CacheReport()))
        return outputs

    def close(self) -> None:
        self.running.clear()
        if self.waits_path:
            with open(self.waits_path, "w") as f:
                json.dump(self.waits, f)


class FirstChunks:
    """ASGI middleware timing each POST from its arrival at the app to its response head and to its first body chunk
    holding a choice's text (the client's first token, less the network and the client)."""

    def __init__(self, app):
        self.app, self.heads, self.firsts = app, [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        t0, first_seen = time.perf_counter(), False

        async def timed(msg):
            nonlocal first_seen
            if msg["type"] == "http.response.start":
                self.heads.append(time.perf_counter() - t0)
            elif not first_seen and b'"text"' in msg.get("body", b""):
                first_seen = True
                self.firsts.append(time.perf_counter() - t0)
            await send(msg)
        await self.app(scope, receive, timed)


def k3_app(pace_s: float, waits_path: str):
    """k3's OpenAI server over an EngineProcess of the stand-in engine (its first-token waits to waits_path)
    → (app, the engine process)."""
    from k3.data import Tokenizer
    from k3.serve.api import create_app
    from k3.serve.engine_process import EngineProcess
    tokenizer = Tokenizer.from_file()  # the bundled one
    proc = EngineProcess(functools.partial(PacedEngine, pace_s, tokenizer.vocab_size, waits_path)).start()
    return create_app(proc, tokenizer, "m"), proc


def serve_and_run(app, client: str, a, profile: int = 0) -> dict:
    """One client row against app, served by uvicorn on this process's main thread (so cProfile sees the
    server's event loop) while the client runs in a process of its own → the row, with the server process's CPU
    seconds (this process: the server's loop, the engine reader thread)."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    row: dict = {}

    def drive():
        while not server.started:
            time.sleep(0.02)
        before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            row.update(run_client(client, f"http://127.0.0.1:{sock.getsockname()[1]}", a))
        finally:
            after = resource.getrusage(resource.RUSAGE_SELF)
            row["server_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            server.should_exit = True
    th = threading.Thread(target=drive, daemon=True)
    th.start()
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    with frozen():  # as `k3 serve` runs (k3.serve.gc_freeze)
        server.run(sockets=[sock])
    if prof is not None:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(profile)
        row["profile"] = out.getvalue()
    th.join()
    sock.close()
    return row


def main():
    ap = load_arguments(__doc__, [4.0, 2.0])
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()
    print(f"{a.streams} streams, {a.requests} requests of {a.output_len} tokens; each client in its own process")
    print("| server | pace | client | out tok/s | ideal tok/s | share | TTFT mean / p99 ms | server CPU s |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    waits = []
    for pace in a.pace_ms:
        ideal = a.streams * 1e3 / pace
        for server in ("k3", "starlette (floor)"):
            for client in ("aiohttp", "k3"):
                r = run_row(server, client, pace, a)
                print(f"| {server} | {pace:g} ms | {client} | {r['out_tok_per_s']:,.0f} | {ideal:,.0f} | "
                      f"{r['out_tok_per_s'] / ideal:.1%} | {r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                      f"{r['server_cpu_s']:.2f} |", flush=True)
                if server == "k3":
                    waits.append((pace, client, r))
    print("\nWhere a k3 request's first token waits (means, ms): the client's TTFT; in the server process, from the "
          "request's arrival at the app to its response head and to its first token's chunk; in the engine, from "
          "the request's arrival to its first token handed over (at most a tick or two)")
    print("| pace | client | client TTFT | server: head | server: first chunk | engine: first token |")
    print("|---|---|---:|---:|---:|---:|")
    for pace, client, r in waits:
        print(f"| {pace:g} ms | {client} | {r['ttft_mean_ms']:.1f} | {r['head_ms']:.1f} | {r['first_chunk_ms']:.1f} | "
              f"{r['engine_first_ms']:.1f} |")
    if a.profile:
        r = run_row("k3", "aiohttp", a.pace_ms[0], a, a.profile)
        print(f"\n== the k3 server process under cProfile at {a.pace_ms[0]:g} ms (aiohttp's load), by own time\n"
              f"{r['profile']}")


def run_row(server: str, client: str, pace: float, a, profile: int = 0) -> dict:
    """One row; for the k3 server also its first-token waits (`FirstChunks`, `PacedEngine.waits`)."""
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        waits_path = os.path.join(tmp, "waits.json")
        if server == "k3":
            app, proc = k3_app(pace / 1e3, waits_path)
            app = timing = FirstChunks(app)
        else:
            app = paced_app(pace)
        try:
            r = serve_and_run(app, client, a, profile)
        finally:
            if proc is not None:
                proc.shutdown()
        if proc is not None:
            with open(waits_path) as f:
                engine_waits = json.load(f)
            mean = lambda xs: 1e3 * sum(xs) / len(xs)  # noqa: E731
            r.update(head_ms=mean(timing.heads), first_chunk_ms=mean(timing.firsts),
                     engine_first_ms=mean(engine_waits))
    assert r["tokens"] == a.requests * a.output_len, r
    return r


if __name__ == "__main__":
    main()
