"""Host (Python) cost per decode step of the serving engine, with and without the HTTP server in front of it.

On a GPU a graphed decode step is a wait on the device; whatever the host does per step (scheduling, sampling
bookkeeping, detokenising, SSE streaming to every client) adds to it, because the engine reads the sampled ids
back each step. This measures that host work on any machine: the `tiny` engine on CPU with its decode graph's
model call replaced by fixed logits and a sleep of --device-ms (the GIL is released, like a device sync).

Rows: "engine alone" steps the engine directly (the peer: no HTTP), "engine alone, CPU time" the same timed by
the engine thread's CPU time (host work only, whatever else loads the CPU); "engine + HTTP" serves the same requests
through the real server to streaming clients in another process (`k3 bench serve`'s load generator); the two
"(trace)" rows time the same by the engine's own trace (the mean period of its decode-only steps), with the engine
on a thread of the server's process and in a process of its own (`k3 serve`'s default). The limit is
--device-ms, the step time if host work cost nothing. Only steps where every sequence decodes are counted.
--sampler instead times one step's sampling of c rows (temperature 1, top-p 0.9, each request with its own
generator): the engine's batched `sample_tokens` against the same sampler called row by row.
Run: OMP_NUM_THREADS=1 python benchmarks/bench_serve_host.py [--concurrency 64] [--device-ms 8.7] [--repeats 2]
     [--no-http] [--staggered] [--logit-columns 1024] [--sampler --vocab 163840 --device cuda]
"""
import argparse
import functools
import statistics
import time

import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import Tokenizer
from k3.model.generate import sample_rows
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from k3.serve import runner as runner_mod
from k3.serve.sampling import make_generator, sample_tokens
from k3.serve.api import create_app
from k3.serve.bench import run_load_in_own_process
from k3.serve.engine_process import EngineProcess, inspect
from k3.serve.local_server import local_server


def fake_engine(c: int, device_ms: float, vocab: int | None = None) -> LLMEngine:
    """A tiny engine whose decode steps cost `device_ms` of GIL-free waiting (also the `build` of the engine's own
    process: the stand-in is patched in there)."""
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg)
    model.reset_parameters(seed=0)
    # vocab: the fixed logits' width (fewer columns: the sampler's argmax, device work on a GPU, costs the CPU less)
    bank = torch.randn(8, c, vocab or cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    calls = [0]

    def fake_forward(self, view):
        calls[0] += 1
        if device_ms > 0:  # (a sleep of 0 still yields the CPU, which on a busy machine costs a time slice)
            time.sleep(device_ms / 1e3)
        return bank[calls[0] % len(bank), :view.rows]

    runner_mod.DecodeGraphs._forward = fake_forward
    return LLMEngine(model.eval(), Tokenizer.from_file(), EngineConfig(
        memory_bytes=1 << 30, block_size=256, match_unit=16, max_batch_tokens=2048, max_num_seqs=c,
        num_state_slots=4 * c, decode_graphs=True))


def build_engine(c: int, device_ms: float, clock=time.perf_counter, vocab: int | None = None
                 ) -> tuple[LLMEngine, list[float]]:
    """`fake_engine` and its step periods by `clock` (time.thread_time: the engine thread's CPU time, the host
    work alone, which time taken by other load on a shared CPU does not inflate)."""
    engine = fake_engine(c, device_ms, vocab)
    periods, last = [], [None]
    step = engine.step

    def timed_step():
        full = (not engine.scheduler.waiting and len(engine.scheduler.running) == c
                and all(not s.in_prefill for s in engine.scheduler.running))
        now = clock()
        if full and last[0] is not None:
            periods.append((now - last[0]) * 1e3)
        last[0] = now if full else None
        return step()

    engine.step = timed_step
    return engine, periods


def engine_alone(c: int, device_ms: float, prompts: list[list[int]], out_len: int,
                 clock=time.perf_counter, vocab: int | None = None) -> list[float]:
    engine, periods = build_engine(c, device_ms, clock, vocab)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    return periods


def engine_http(c: int, device_ms: float, input_len: int, out_len: int) -> list[float]:
    engine, periods = build_engine(c, device_ms)
    with torch.inference_mode(), local_server(create_app(engine, engine.tokenizer, "k3")) as url:
        check(run_load_in_own_process(url, "k3", "random", c, c, None, input_len, out_len, 1, None, 0))
    return periods


def engine_http_traced(c: int, device_ms: float, input_len: int, out_len: int, process: bool) -> list[float]:
    """The HTTP row timed by the engine's own trace (`StepLog`: the mean period of its decode-only steps), with
    the engine on a thread of the server's process or in a process of its own (k3.serve.engine_process)."""
    if process:
        engine = EngineProcess(functools.partial(fake_engine, c, device_ms), warm_up=False).start()
        ask = engine.call
    else:
        engine = fake_engine(c, device_ms)
        ask = functools.partial(inspect, engine)
    with torch.inference_mode(), local_server(create_app(engine, Tokenizer.from_file(), "k3")) as url:
        ask("trace")
        s = check(run_load_in_own_process(url, "k3", "random", c, c, None, input_len, out_len, 1, None, 0))
        decode = ask("trace_summary", s["wall_s"])["decode"]
        return [decode["period_ms"]] * decode["steps"]  # (the table's median of these is the mean period)


def check(s: dict) -> dict:
    if s["failed"] or s["wrong_length"]:
        raise RuntimeError(f"the load failed: {s['failed']} failed, {s['wrong_length']} wrong length")
    return s


def sampler_table(c: int, vocab: int, device: str, reps: int = 20) -> None:
    """ms per step: one batched sample_tokens call against c calls of the same sampler on one row each."""
    logits = torch.randn(c, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(c)]
    gens = [make_generator(p) for p in params]

    def per_row():
        for i, p in enumerate(params):
            sample_rows(logits[i:i + 1], [p.temperature], [p.top_k], [p.top_p], torch.rand(1, generator=gens[i]))

    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    print(f"sampling one step of {c} rows, vocab {vocab}, temperature 1, top-p 0.9, {device}")
    print("| sampler | ms per step |\n|---|---:|")
    for name, fn in (("batched sample_tokens (k3 engine)", lambda: sample_tokens(logits, params, gens)),
                     ("row by row (the previous engine loop)", per_row)):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        print(f"| {name} | {(time.perf_counter() - t0) / reps * 1e3:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=8.7, help="the device's step (H200, small, batch 64: 8.7)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--logit-columns", type=int, default=None, help="the CPU-time row: the fixed logits' width "
                    "(default the vocabulary; e.g. 1024 leaves the sampler's argmax, device work on a GPU, out)")
    ap.add_argument("--no-http", action="store_true", help="the engine alone (no server, no client process)")
    ap.add_argument("--staggered", action="store_true", help="prompt lengths input_len + i mod 16: the streams "
                    "reach their 16-token match boundaries (a KDA checkpoint each) at different steps, as under "
                    "real load, instead of all on the same step")
    ap.add_argument("--sampler", action="store_true", help="time the sampler alone (see the docstring)")
    ap.add_argument("--vocab", type=int, default=163840, help="--sampler: vocabulary size")
    ap.add_argument("--device", default="cpu", help="--sampler: where the logits live")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.sampler:
        return sampler_table(a.concurrency, a.vocab, a.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (a.input_len + (i % 16 if a.staggered else 0),), generator=g).tolist()
               for i in range(a.concurrency)]
    rows = []
    runs = [("engine alone", lambda: engine_alone(a.concurrency, a.device_ms, prompts, a.output_len)),
            ("engine alone, CPU time", lambda: engine_alone(a.concurrency, a.device_ms, prompts, a.output_len,
                                                             time.thread_time, a.logit_columns)),
            ("engine + HTTP", lambda: engine_http(a.concurrency, a.device_ms, a.input_len, a.output_len)),
            ("engine + HTTP, one process (trace)", lambda: engine_http_traced(
                a.concurrency, a.device_ms, a.input_len, a.output_len, False)),
            ("engine + HTTP, engine process (trace)", lambda: engine_http_traced(
                a.concurrency, a.device_ms, a.input_len, a.output_len, True))]
    for name, run in runs[:2] if a.no_http else runs:
        for r in range(a.repeats):
            p = run()
            rows.append((name, r, len(p), statistics.median(p), statistics.median(p) - a.device_ms))
    print(f"c={a.concurrency}, device stand-in {a.device_ms} ms per step (the limit), tiny on CPU, 1 thread")
    print("| run | repeat | full decode steps | step period median ms | host ms per step |")
    print("|---|---:|---:|---:|---:|")
    for name, r, n, med, host in rows:
        cpu = "CPU time" in name  # the thread's CPU time per step: host work only, the device's wait left out
        print(f"| {name} | {r} | {n} | {'-' if cpu else f'{med:.2f}'} | {med if cpu else host:.2f} |")


if __name__ == "__main__":
    main()
