"""The engine in a process of its own, the HTTP server in another (vLLM's API-server / EngineCore split).

In one process the server's Python (HTTP parsing, tokenising, validating, rendering every stream's chunks) and the
engine thread's (a prompt step through piecewise CUDA graphs is ~18 ms of host Python on an H200) take turns on one
GIL. On an H200 at 64 streams the engine alone ran 2,048-token prompt steps every 19 ms, and behind HTTP in the
same process ~1,000-token ones every 34-43 ms (benchmarks/RESULTS.md, issue 21). Here they run side by side.

`EngineProcess` is both faces the server needs: the engine's (`limits`, `check_request`, `max_model_len`,
`vision_config`, `metrics`) and the runner's (`submit`, `abort`, `shutdown`, `error`, as k3.serve.engine.
EngineThread), so `create_app(proc, tokenizer, runner=proc)` serves it unchanged. Requests are checked in the server
process (`RequestLimits`), before anything is sent.

Wire: one duplex pipe (multiprocessing.Connection, pickled tuples; tensors in images by shared memory).
  server → engine: ("add", prompt, params, rid, checkpoint_at, images, policy_version), ("abort", rid),
                   ("metric", name, args) (the server's own counters), ("call", n, name, args), ("stop",)
  engine → server: ("ready", info) once, then ("out", [wire outputs]) once per engine iteration,
                   ("reply", n, ok, value), and ("failed", message) when the engine crashed (its requests' error
                   outputs come first).
Outputs cross as increments (new ids, text and logprobs; the full text and cache report with the last one); the
server rebuilds each request's ids and text, so a step's message does not grow with the sequences' lengths.
If the engine process dies, every request in flight ends with an error output and `error` is set (/health: 503);
if the server process dies, the engine process sees its pipe close and exits."""
from __future__ import annotations

import functools
import gc
import itertools
import os
import threading
from typing import Callable

from k3.serve import gc_freeze
from k3.serve.engine import EngineThread, LLMEngine, RequestLimits, check_policy_version
from k3.serve.metrics import StepLog
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import OutputIds, RequestOutput

START_TIMEOUT_S = 1800.0  # loading a released checkpoint and capturing every graph can take minutes
CALL_TIMEOUT_S = 60.0


# ---- what the server may ask of the engine (run in the engine's process, or locally on an in-process engine) ----
def _trace(engine: LLMEngine) -> None:
    engine.step_log = StepLog(engine.metrics)


def _trace_summary(engine: LLMEngine, wall_s: float, start_s: float | None = None) -> dict:
    log, engine.step_log = engine.step_log, None
    return log.summary(wall_s, start_s)


def _profile(engine: LLMEngine) -> None:
    import cProfile
    engine.profiler = cProfile.Profile()


def _profile_summary(engine: LLMEngine, top: int) -> str:
    """The profile's `top` functions by own time, then by cumulative time (pstats' tables), and stop profiling."""
    import io
    import pstats
    prof, engine.profiler = engine.profiler, None
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def graph_keys_used(engine: LLMEngine) -> int:
    """How many decode-graph (rows, width) keys and prefill-graph token buckets the engine has used so far (on
    CUDA each was captured at its first use; on CPU the same keys are made, run eagerly)."""
    runner = engine.runner
    return sum(len(g.entries) for g in (runner.graphs, runner.prefill_graphs) if g is not None)


def _pool_usage(engine: LLMEngine) -> tuple[int, int, bool]:
    return engine.pool.num_used_blocks, engine.pool.num_used_slots, engine.has_unfinished()


CALLS: dict[str, Callable] = {
    "metrics": lambda engine, accept: engine.metrics.render(engine, accept),  # the /metrics body
    "trace": _trace,  # benchmarks: trace every step from now (StepLog) ...
    "trace_summary": _trace_summary,  # ... and stop, → its summary over a run of wall_s seconds (from start_s)
    "profile": _profile,  # benchmarks: every step the engine thread runs from now under cProfile ...
    "profile_summary": _profile_summary,  # ... and stop, → pstats' tables of the top functions
    "graph_keys": graph_keys_used,
    "pool_usage": _pool_usage,  # (blocks held, state slots held, requests unfinished)
    "gc_frozen": lambda engine: gc.get_freeze_count(),  # objects exempt from the collector (k3.serve.gc_freeze)
}
METRICS = ("on_request", "on_abort", "describe_model")  # the counters the server keeps on the engine's Metrics


def inspect(engine: LLMEngine, name: str, *args):
    """CALLS[name] on an engine in this process: what `EngineProcess.call` runs in the engine's."""
    return CALLS[name](engine, *args)


# ---- the engine's process ----------------------------------------------------------------------------------
def build_engine(make_model: Callable, tokenizer, config) -> LLMEngine:
    """A `build` for EngineProcess: the model made in the engine's process (a checkpoint loaded there, or a preset
    initialised from its seed: never sent across), then its engine."""
    return LLMEngine(make_model(), tokenizer, config)


def _wire(o: RequestOutput) -> tuple:
    last = o.finished
    return (o.request_id, o.new_token_ids, o.new_text, o.new_logprobs, last, o.finish_reason, o.prompt_tokens,
            o.cache if last else None, o.prompt_logprobs, o.text if last else None)


def _error_wire(rid: str, message: str, prompt_tokens: int) -> tuple:
    return (rid, [], "", [], True, f"error: {message}", prompt_tokens, None, None, "")


def _engine_main(conn, build: Callable[[], LLMEngine], warm_up: bool, threads: int) -> None:
    """The engine process: build the engine, warm it up, then step it on its own thread while this one reads the
    pipe. Ends when the server says stop or its end of the pipe closes. threads: torch's intra-op threads, as
    the server's process had them (a spawned process starts from the default, one per core)."""
    import signal

    import torch

    torch.set_num_threads(threads)
    # Ctrl-C reaches the whole process group: the server stops this process in order (its shutdown), not the key
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock = threading.Lock()  # the engine thread and this one both send

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    try:
        engine = build()
        made = engine.warm_up() if warm_up else 0
        gc_freeze.freeze()  # the model and the engine: out of every later full collection (a step waits for one)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the server must hear it instead of waiting
        send(("failed", f"{type(e).__name__}: {e}"))
        return
    outbox: list[RequestOutput] = []
    box_lock = threading.Lock()

    def listen(out: RequestOutput) -> None:
        with box_lock:
            outbox.append(out)

    def flush() -> None:  # on the engine thread, once an iteration's outputs are in
        with box_lock:
            batch = [_wire(o) for o in outbox]
            outbox.clear()
        if batch:
            send(("out", batch))
        if thread.error is not None:
            send(("failed", f"{type(thread.error).__name__}: {thread.error}"))

    thread = EngineThread(engine, after_outputs=flush)
    thread.start()
    send(("ready", dict(limits=engine.limits, vision_config=engine.vision_config, pid=os.getpid(),
                        capacity=engine.describe_capacity(), graphs=made)))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the server has gone: so does its engine
            kind = msg[0]
            if kind == "add":
                _, prompt, params, rid, ckpt, images, version = msg
                try:
                    thread.submit(prompt, params, rid, listen, ckpt, images, version)
                except (ValueError, TypeError) as e:  # checked by the server already: only a bug gets here
                    send(("out", [_error_wire(rid, str(e), len(prompt))]))
            elif kind == "abort":
                thread.abort(msg[1])
            elif kind == "metric" and msg[1] in METRICS:
                getattr(engine.metrics, msg[1])(*msg[2])
            elif kind == "call":
                _, n, name, args = msg
                try:
                    send(("reply", n, True, inspect(engine, name, *args)))
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    send(("reply", n, False, f"{type(e).__name__}: {e}"))
            elif kind == "stop":
                return
    finally:
        thread.shutdown()
        engine.close()


# ---- the server's side -------------------------------------------------------------------------------------------
class RemoteMetrics:
    """The engine process's Metrics as the server uses them: its counters are sent over, /metrics is asked for."""

    def __init__(self, proc: "EngineProcess"):
        self._proc = proc

    def _count(self, name: str, *args) -> None:
        self._proc._send(("metric", name, args))

    on_request = functools.partialmethod(_count, "on_request")
    on_abort = functools.partialmethod(_count, "on_abort")
    describe_model = functools.partialmethod(_count, "describe_model")

    def render(self, _engine, accept: str | None = None) -> tuple[bytes, str]:
        return self._proc.call("metrics", accept)


class _Stream:
    """One request as the server sees it: its listener, and its output ids and text so far."""
    __slots__ = ("on_output", "ids", "text")

    def __init__(self, on_output):
        self.on_output, self.ids, self.text = on_output, [], ""


class EngineProcess:
    """An LLMEngine built and stepped in a child process (spawned: CUDA cannot fork), driven from this one.
    build: a picklable callable that returns the engine in the child (e.g. functools.partial(build_engine,
    make_model, tokenizer, config)); warm_up: run `LLMEngine.warm_up` before ready."""

    def __init__(self, build: Callable[[], LLMEngine], warm_up: bool = True, start_timeout: float = START_TIMEOUT_S):
        self._build, self._warm_up, self._start_timeout = build, warm_up, start_timeout
        self._proc = self._conn = self._reader = None
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, list] = {}  # n → [event, ok, value]
        self._numbers = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self.info: dict = {}
        self.metrics = RemoteMetrics(self)

    # ---- lifetime ----------------------------------------------------------------------------------------
    def start(self) -> "EngineProcess":
        """Spawn the engine process and wait until its engine is built and warm (again: nothing)."""
        if self._proc is not None:
            return self
        import torch
        import torch.multiprocessing as mp  # its pickler sends tensors (in images) by shared memory

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, name="k3-engine", daemon=True,
                                 args=(child, self._build, self._warm_up, torch.get_num_threads()))
        self._proc.start()
        child.close()  # ours is the only server end: its close is the engine's EOF
        if not self._conn.poll(self._start_timeout):
            self._kill()
            raise RuntimeError(f"the engine process did not start within {self._start_timeout:g} s")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if msg[0] != "ready":
            self._proc.join(5)
            raise RuntimeError(f"the engine failed to start: {msg[1]}")
        self.info = msg[1]
        self._reader = threading.Thread(target=self._read, name="k3-engine-reader", daemon=True)
        self._reader.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc is None or self._stopping:
            return
        self._stopping = True
        self._send(("stop",))
        self._proc.join(timeout)
        self._kill()
        self._conn.close()
        if self._reader is not None:
            self._reader.join(timeout)

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- the engine's face --------------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        return self.info["limits"]

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vision_config(self):
        return self.info["vision_config"]

    def describe_capacity(self) -> str:
        return self.info["capacity"]

    def check_request(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> None:
        self.limits.check(prompt, params, images)

    def call(self, name: str, *args, timeout: float = CALL_TIMEOUT_S):
        """CALLS[name](engine, *args) in the engine's process → its value (RuntimeError if it raised there, the
        engine has failed, or no answer came within timeout)."""
        if name not in CALLS:
            raise KeyError(f"no engine call {name!r}; known: {sorted(CALLS)}")
        n, done = next(self._numbers), threading.Event()
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the engine has failed: {self.error}")
            self._calls[n] = slot = [done, False, None]
        self._send(("call", n, name, args))  # (if the engine is gone, its reader answers every call)
        if not done.wait(timeout):
            self._calls.pop(n, None)
            raise RuntimeError(f"the engine did not answer {name!r} within {timeout:g} s")
        if not slot[1]:
            raise RuntimeError(f"engine call {name!r} failed: {slot[2]}")
        return slot[2]

    # ---- the runner's face --------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str,
               on_output: Callable[[RequestOutput], None], checkpoint_at: list[int] | None = None,
               images: list | None = None, policy_version: int | str | None = None) -> None:
        self.check_request(prompt, params, images)  # raise in the caller's thread, before anything is sent
        check_policy_version(policy_version)
        with self._lock:
            if self.error is None:
                self._streams[request_id] = _Stream(on_output)
        if self.error is not None:  # a dead engine: the request ends at once, as those in flight did
            on_output(RequestOutput(request_id, [], "", [], [], "", True, f"error: {self.error}", len(prompt), None))
            return
        self._send(("add", prompt, params, request_id, checkpoint_at, images, policy_version))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def _send(self, msg) -> bool:
        """Send to the engine process; False when it is gone (its reader then ends every request and call that
        was waiting on it, this one's included)."""
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # a broken or closed pipe
            return False

    def _read(self) -> None:
        """The reader thread: outputs to their listeners, replies to their callers, until the pipe closes."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    self._deliver(msg[1])
                elif msg[0] == "reply":
                    slot = self._calls.pop(msg[1], None)
                    if slot is not None:
                        slot[1], slot[2] = msg[2], msg[3]
                        slot[0].set()
                elif msg[0] == "failed":
                    self._fail(RuntimeError(msg[1]))
        except (EOFError, OSError):
            if not self._stopping:
                self._proc.join(5)
                self._fail(RuntimeError(f"the engine process exited (exit code {self._proc.exitcode})"))

    def _deliver(self, batch: list[tuple]) -> None:
        for rid, new_ids, new_text, new_lps, last, reason, prompt_tokens, cache, prompt_lps, text in batch:
            with self._lock:
                st = self._streams.pop(rid, None) if last else self._streams.get(rid)
            if st is None:
                continue  # aborted here already
            st.ids += new_ids
            st.text = text if last else st.text + new_text
            st.on_output(RequestOutput(rid, new_ids, new_text, new_lps, OutputIds(st.ids, 0, len(st.ids)), st.text,
                                       last, reason, prompt_tokens, cache, prompt_lps))

    def _fail(self, e: BaseException) -> None:
        """The engine is gone: every request in flight ends with an error, every waiting call returns."""
        with self._lock:
            if self.error is None:
                self.error = e
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        for rid, st in streams.items():
            st.on_output(RequestOutput(rid, [], "", [], [], "", True, f"error: {e}", 0, None))
        for slot in calls.values():
            slot[1], slot[2] = False, str(e)
            slot[0].set()
