"""One serving path for /v1/completions and /v1/chat/completions: a request becomes sequences (prompts × n) on the
engine thread; their outputs are streamed as SSE chunks or collected into one body. Only the rendering differs
between the two routes (CompletionRenderer, ChatRenderer); submission, disconnect handling, aborts, usage and the
SSE error event live here once."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from k3.serve.protocol import MAX_SEED
from k3.serve.sampling import SamplingParams

INLINE_BODY_BYTES = 8 << 10  # a request body up to this is parsed, tokenised and queued on the event loop itself

_CLIENT_GONE = object()


class APIError(Exception):
    """A request the server refuses or fails: rendered as OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(status: int, message: str, param=None, type_="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(status_code=status, content=APIError(status, message, param, type_, code).body())


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"  # json.dumps with default options reuses its one C encoder


class LoopMailbox:
    """Outputs from the engine thread to an event loop's request queues, with one wake-up of the loop per
    burst (an engine step's outputs for every stream) instead of one `call_soon_threadsafe` per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.items, self.scheduled = loop, threading.Lock(), [], False

    def put(self, queue: asyncio.Queue, item) -> None:  # engine thread
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class SSEResponse(StreamingResponse):
    """A text/event-stream response streamed in the request's own task. Starlette, for servers of ASGI spec 2.3
    (uvicorn's), runs the stream as a second task beside one listening for the client's disconnect: a hop that
    waits behind every other stream's chunks under load (64 streams on a 2-core VM: ~20 ms of each response head,
    benchmarks/bench_serve_frontend.py). The disconnect is watched already (`Serving.outputs` ends the stream);
    meanwhile uvicorn drops sends to a client that has gone, and a server of spec 2.4 raises OSError."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass


def mark_body(request: Request, size: int) -> None:
    """Note whether the request is small enough for `off_loop` to do its work on the event loop."""
    request.state.inline = size <= INLINE_BODY_BYTES


async def off_loop(request: Request, fn, inline: bool = True):
    """fn() on a worker thread, or here for a small request (`mark_body`; and `inline`: the caller's own say, e.g.
    no grammar to compile). A long prompt takes seconds to tokenise and must not stall every stream; a small one
    takes ~0.5 ms, less than the hop: under load the worker waits for the GIL behind the event loop and the engine's
    reader (5 ms switch interval), and its result waits behind every stream's chunks (a request took three)."""
    if inline and getattr(request.state, "inline", False):
        return fn()
    return await asyncio.to_thread(fn)


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to go, then tell the request's reader through its queue. The body has been read, so the
    server answers the next `receive` with http.disconnect once the connection closes (ASGI). One pending receive
    costs nothing while it waits; polling `Request.is_disconnected` every 0.25 s (before) cost ~250 µs a poll on
    the 2-core VM, 10% of the server's loop at 64 streams (benchmarks/bench_serve_frontend.py --profile)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_CLIENT_GONE)


@dataclass
class Job:
    """What one HTTP request asks the engine for: each prompt sampled n times (choice = prompt_index * n + i)."""
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    checkpoint_at: list | None = None  # per prompt, or None
    images: list | None = None  # for the single chat prompt
    policy_version: int | str | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class Collected:
    """A choice's outputs gathered for a non-streaming body."""
    final: object = None  # the finished RequestOutput
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's params: with a seed, each choice of a prompt gets its own (seed + i, wrapping at 2^64)."""
    if i == 0 or params.seed is None:
        return params
    return SamplingParams(**{**vars(params), "seed": (params.seed + i) % MAX_SEED})


class Serving:
    """Submits jobs to the engine thread and turns their outputs into HTTP responses."""

    def __init__(self, runner, metrics):
        self.runner, self.metrics = runner, metrics
        self.mailbox: LoopMailbox | None = None  # set at startup, on the server's loop

    async def outputs(self, request: Request, job: Job) -> AsyncIterator[tuple[int, object]]:
        """Submit every choice; yield (choice index, RequestOutput) as they come; abort the unfinished on exit
        (client gone, error, or the consumer stopped)."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = uuid.uuid4().hex
        ids = [f"{rid}-{c}" for c in range(job.num_choices)]
        box = self.mailbox

        def submit_all():  # off the loop: the engine's check of a long prompt is a Python pass over its ids
            for c, sub in enumerate(ids):
                p = job.prompts[c // job.n]
                ckpt = job.checkpoint_at[c // job.n] if job.checkpoint_at else None
                self.runner.submit(p, choice_params(job.params, c % job.n), sub,
                                   lambda out, c=c: box.put(queue, (c, out)), ckpt, job.images, job.policy_version)
                submitted.add(c)
            for _ in job.prompts:
                self.metrics.on_request(job.n, job.params.max_tokens)

        submitted: set[int] = set()
        pending = set(range(job.num_choices))
        # The connection is watched by a task of its own: a busy engine sends output every step, so waiting for a
        # pause would let a plain (non-streaming) request whose client left run to max_tokens; and a timeout on
        # every queue read would cost a task and a timer per token.
        watcher = asyncio.ensure_future(_watch_disconnect(request, queue))
        try:
            try:
                await off_loop(request, submit_all)
            except ValueError as e:
                raise APIError(400, str(e), "prompt")
            while pending:
                item = await queue.get()
                if item is _CLIENT_GONE:
                    return
                c, out = item
                if out.finished:
                    pending.discard(c)
                    if out.finish_reason and out.finish_reason.startswith("error"):
                        raise APIError(500, f"the engine failed: {out.finish_reason[6:].strip()}",
                                       type_="server_error")
                yield c, out
        finally:
            watcher.cancel()
            aborted = pending & submitted
            for c in aborted:  # client gone (or error): cancel, freeing blocks and the state slot
                self.runner.abort(ids[c])
            if aborted:
                self.metrics.on_abort(len(aborted))

    async def collect(self, request: Request, job: Job) -> list[Collected] | None:
        """Run a job to its end → one Collected per choice, or None when the client left first."""
        got = [Collected() for _ in range(job.num_choices)]
        done = 0
        async for c, out in self.outputs(request, job):
            got[c].logprobs += out.new_logprobs
            if getattr(out, "prompt_logprobs", None) is not None:
                got[c].prompt_logprobs = out.prompt_logprobs
            if out.finished:
                got[c].final = out
                done += 1
        return got if done == job.num_choices else None

    async def respond(self, request: Request, job: Job, renderer, stream: bool, include_usage: bool):
        """The HTTP response of a job: an SSE stream of the renderer's chunks, or its full body."""
        if stream:
            return SSEResponse(self._events(request, job, renderer, include_usage))
        got = await self.collect(request, job)
        if got is None:
            return error_response(499, "client closed request")
        body = await asyncio.to_thread(renderer.body, got)  # detokenising long echoed prompts: off the loop
        body["usage"] = usage(job, [g.final for g in got])
        body["k3_cache"] = got[0].final.cache.as_dict() if got[0].final.cache else None
        return JSONResponse(body)

    async def _events(self, request: Request, job: Job, renderer, include_usage: bool):
        last: dict[int, object] = {}
        try:
            for chunk in renderer.opening(job.num_choices):
                yield sse(chunk)
            async for c, out in self.outputs(request, job):
                last[c] = out
                for chunk in renderer.stream(c, out):
                    yield sse(chunk)
            if include_usage and len(last) == job.num_choices:
                first = last[0]
                yield sse({**renderer.header(), "choices": [], "usage": usage(job, [last[c] for c in sorted(last)]),
                           "k3_cache": first.cache.as_dict() if first.cache else None})
        except APIError as e:  # mid-stream failure: OpenAI's/vLLM's SSE error event, then the end of the stream
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - a renderer bug must still end the stream properly
            yield sse(APIError(500, f"internal error: {type(e).__name__}", type_="server_error").body())
        yield "data: [DONE]\n\n"


def usage(job: Job, finals: list) -> dict:
    """OpenAI's usage: each prompt counted once (not once per choice), every choice's generated tokens."""
    firsts = finals[::job.n]
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(o.output_ids) for o in finals)
    cached = sum(o.cache.restored_tokens if o.cache else 0 for o in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
