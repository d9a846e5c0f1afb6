"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions (SSE streaming), models, health,
Prometheus metrics, tokenize/detokenize. Every bad request gets a 4xx JSON error in OpenAI's shape.
/v1/chat/completions speaks K3's chat format (SPEC §1.2): `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format` (json_object, json_schema) enforced by a grammar (k3.serve.grammar), `tool_calls` and
`reasoning_content` (also as stream deltas), vLLM's `chat_template_kwargs` (thinking, thinking_effort) and
OpenAI's `reasoning_effort`; a chat field k3 does not know is a 400 naming it.
k3 extensions (all optional): `policy_version` (prefix-cache namespace), `return_token_ids` (generated ids per
choice and per streamed chunk, prompt ids per choice: raw-token continuation without re-tokenising), and on
/v1/completions `checkpoint_at` (prompt positions, e.g. tool-turn ends, worth a KDA checkpoint)."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.data.chat_template import THINKING_EFFORTS
from k3.serve.chat_template import render_chat
from k3.serve.engine import EngineThread, LLMEngine
from k3.serve.grammar import Grammar, GrammarError, chat_grammar
from k3.serve.output_parser import OutputParser
from k3.serve.sampling import SamplingParams

MAX_N = 4
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still connected


_CLIENT_GONE = object()


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Every DISCONNECT_POLL_S, check the client; once it has gone, tell the request's reader through its queue."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    queue.put_nowait(_CLIENT_GONE)


class _LoopMailbox:
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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


def error_response(status: int, message: str, param=None, type_="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param,
                                                               "code": code}})


class BearerAuth:
    """ASGI middleware: /v1/* needs 'Authorization: Bearer KEY'. Plain ASGI rather than @app.middleware("http"):
    Starlette's BaseHTTPMiddleware wraps `receive` so that Request.is_disconnected() never sees a disconnect."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    policy_version: Union[int, str, None] = None  # k3 extension: prefix-cache namespace (RL weight version)
    return_token_ids: bool = False  # k3 extension: generated ids per choice / per streamed chunk


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    checkpoint_at: list[int] | None = None  # k3 extension: prompt positions worth a KDA checkpoint (turn ends)


class ChatTemplateKwargs(BaseModel):
    """vLLM's `chat_template_kwargs`: the options of K3's chat template (an unknown one is a 400)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    thinking: bool = True
    thinking_effort: str | None = None


class ChatRequest(_Common):
    """An unknown field is a 400 naming it: a chat option k3 would otherwise drop silently (logit_bias, audio, …)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | None = None  # OpenAI's: low, medium, high (and k3's max); none turns thinking off
    user: str | None = None  # accepted for compatibility: an end-user label with no effect on the output
    metadata: dict[str, str] | None = None  # likewise


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def create_app(engine: LLMEngine, tokenizer, model_name: str = "k3", api_key: str | None = None,
               max_tokens_limit: int | None = None) -> FastAPI:
    """The FastAPI app around an engine (started and stopped with the app's lifespan)."""
    runner = EngineThread(engine)
    max_len = engine.max_model_len
    max_tokens_limit = min(max_tokens_limit or max_len, max_len)

    @asynccontextmanager
    async def lifespan(app):
        app.state.mailbox = _LoopMailbox(asyncio.get_running_loop())  # the server's loop
        runner.start()
        try:
            yield
        finally:
            runner.shutdown()

    app = FastAPI(title="k3 serve", lifespan=lifespan)
    app.state.runner, app.state.engine = runner, engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return error_response(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500
                              else "server_error")

    @app.exception_handler(Exception)
    async def _server_error(request, e):
        return error_response(500, f"internal error: {type(e).__name__}", type_="server_error")

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    async def parse(request: Request, cls):
        try:
            body = await request.json()
        except Exception:
            raise APIError(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            if err["type"] == "extra_forbidden":
                raise APIError(400, f"{param}: k3 does not support this field", param)
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param)

    def check_model(req) -> None:
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "model", code="model_not_found")

    def sampling_params(req, max_tokens, logprobs) -> SamplingParams:
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.presence_penalty or req.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported (use 0)", "presence_penalty")
        if max_tokens is None:
            max_tokens = 16 if isinstance(req, CompletionRequest) else max(1, min(max_tokens_limit, 512))
        if max_tokens < 1 or max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}", "max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                                  ignore_eos=req.ignore_eos, logprobs=logprobs)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(" ")[0])

    def image_collector():
        """(list the images land in, media callback for render_chat, or None for a text-only model)."""
        vision = getattr(engine.model, "vision_config", None)
        images: list = []
        if vision is None:
            return images, None
        from k3.vision.multimodal import image_token_ids
        from k3.vision.preprocess import preprocess_image

        def media(url: str, where: str) -> list[int]:
            try:
                im = preprocess_image(url, vision)
            except ValueError as e:  # ImageError: bad data URL, remote URL, corrupt or absurd image
                raise ValueError(f"{where}: {e}") from None
            images.append(im)
            return image_token_ids(tokenizer, im)
        return images, media

    def check_prompt(ids: list[int], params: SamplingParams, images=None) -> None:
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        try:
            engine.check_request(ids, params, images)
        except ValueError as e:
            raise APIError(400, str(e), "prompt")

    async def run_choices(request: Request, prompt, params: SamplingParams, n: int, checkpoint_at=None, images=None,
                          policy_version=None):
        """Submit n sequences; yield (choice index, RequestOutput) as they come; abort all on exit."""
        box = app.state.mailbox
        queue: asyncio.Queue = asyncio.Queue()
        rid = uuid.uuid4().hex
        ids = [f"{rid}-{i}" for i in range(n)]
        for i, sub in enumerate(ids):
            p = params if n == 1 or params.seed is None else SamplingParams(**{**vars(params), "seed": params.seed + i})
            runner.submit(prompt, p, sub, lambda out, i=i: box.put(queue, (i, out)),
                          checkpoint_at, images, policy_version)
        pending = set(range(n))
        # The connection is checked on a clock by a task of its own: a busy engine sends output every step, so
        # waiting for a pause would let a plain (non-streaming) request whose client left run to max_tokens; and
        # a timeout on every queue read would cost a task and a timer per token.
        watcher = asyncio.ensure_future(_watch_disconnect(request, queue))
        try:
            while pending:
                item = await queue.get()
                if item is _CLIENT_GONE:
                    return
                i, out = item
                if out.finished:
                    pending.discard(i)
                    if out.finish_reason and out.finish_reason.startswith("error"):
                        raise APIError(500, out.finish_reason, type_="server_error")
                yield i, out
        finally:
            watcher.cancel()
            for i in pending:  # client gone (or error): cancel, freeing blocks and the state slot
                runner.abort(ids[i])

    async def run_to_end(choices, n: int):
        """Non-streaming: drain run_choices → ({index: final output}, {index: logprobs}), or (None, None)
        when the client left before every choice finished."""
        finals, lps = {}, {i: [] for i in range(n)}
        async for i, out in choices:
            lps[i] += out.new_logprobs
            if out.finished:
                finals[i] = out
        return (finals, lps) if len(finals) == n else (None, None)

    def usage(prompt_tokens: int, completion: int, cache) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cache.restored_tokens if cache else 0}}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # ---- endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if runner.error is not None:
            return error_response(503, f"engine failed: {runner.error}", type_="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3", "max_model_len": max_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        try:
            ids = (tokenizer.encode(req.prompt) if req.prompt is not None
                   else render_chat(tokenizer, req.messages, req.add_generation_prompt, media=image_collector()[1])[0])
        except ValueError as e:
            raise APIError(400, str(e), "messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, DetokenizeRequest)
        try:
            return {"prompt": tokenizer.decode(req.tokens)}
        except ValueError as e:
            raise APIError(400, str(e), "tokens")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        check_model(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(400, f"logprobs must be in [0, 5], got {req.logprobs}", "logprobs")
        params = sampling_params(req, req.max_tokens, req.logprobs)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, params)
        ckpt = req.checkpoint_at
        if ckpt is not None and (len(ckpt) > 1024 or not all(0 <= c <= len(ids) for c in ckpt)):
            raise APIError(400, f"checkpoint_at must be at most 1024 positions in [0, {len(ids)}] (the prompt)",
                           "checkpoint_at")
        cid, model = f"cmpl-{uuid.uuid4().hex}", model_name

        def lp_block(lps, offset):
            if req.logprobs is None:
                return None
            toks = [tokenizer.decode([lp.token_id]) for lp in lps]
            return {"tokens": toks, "token_logprobs": [lp.logprob for lp in lps],
                    "top_logprobs": [{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
                    "text_offset": list(range(offset, offset + len(lps)))}

        if req.stream:
            async def events():
                total, cache = 0, None
                async for i, out in run_choices(request, ids, params, req.n, ckpt, None, req.policy_version):
                    total += len(out.new_token_ids)
                    cache = out.cache or cache
                    # with token ids on, every token is sent at once, even while its text is held back
                    if out.new_text or out.finished or (req.return_token_ids and out.new_token_ids):
                        choice = {"index": i, "text": out.new_text, "logprobs": lp_block(out.new_logprobs, 0),
                                  "finish_reason": out.finish_reason if out.finished else None}
                        if req.return_token_ids:
                            choice["token_ids"] = list(out.new_token_ids)
                        yield sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                                   "choices": [choice]})
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                               "choices": [], "usage": usage(len(ids), total, cache),
                               "k3_cache": cache.as_dict() if cache else None})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        finals, lps = await run_to_end(run_choices(request, ids, params, req.n, ckpt, None, req.policy_version), req.n)
        if finals is None:  # client went away
            return error_response(499, "client closed request")
        outs = [finals[i] for i in range(req.n)]
        ids_field = ({"token_ids": list(o.output_ids), "prompt_token_ids": list(ids)} if req.return_token_ids else {}
                     for o in outs)
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": i, "text": (tokenizer.decode(ids) if req.echo else "") + o.text,
                             "logprobs": lp_block(lps[i], 0), "finish_reason": o.finish_reason, **extra}
                            for i, (o, extra) in enumerate(zip(outs, ids_field))],
                "usage": usage(len(ids), sum(len(o.output_ids) for o in outs), outs[0].cache),
                "k3_cache": outs[0].cache.as_dict()}

    grammars: OrderedDict = OrderedDict()  # compiled constraints by grammar text (LRU): clients repeat schemas

    def chat_thinking(req) -> tuple[bool, str | None]:
        """(thinking on, thinking effort) from vLLM's chat_template_kwargs and OpenAI's reasoning_effort."""
        kw = req.chat_template_kwargs or ChatTemplateKwargs()
        thinking, effort = kw.thinking, kw.thinking_effort
        if effort is not None and effort not in THINKING_EFFORTS:
            raise APIError(400, f"chat_template_kwargs.thinking_effort must be one of {', '.join(THINKING_EFFORTS)}; "
                                f"got {effort!r}", "chat_template_kwargs.thinking_effort")
        r = req.reasoning_effort
        if r is not None:
            if r not in ("none", *THINKING_EFFORTS):
                raise APIError(400, f"reasoning_effort must be one of none, {', '.join(THINKING_EFFORTS)}; got {r!r}",
                               "reasoning_effort")
            if r == "none":
                if "thinking" in kw.model_fields_set and kw.thinking:
                    raise APIError(400, "reasoning_effort 'none' contradicts chat_template_kwargs.thinking true",
                                   "reasoning_effort")
                thinking = False
            elif effort is not None and effort != r:
                raise APIError(400, f"reasoning_effort {r!r} contradicts chat_template_kwargs.thinking_effort "
                                    f"{effort!r}", "reasoning_effort")
            else:
                effort = r
        if effort is not None and not thinking:
            param = "chat_template_kwargs.thinking_effort" if kw.thinking_effort else "reasoning_effort"
            raise APIError(400, f"{param} {effort!r} needs thinking on (chat_template_kwargs.thinking is false)", param)
        return thinking, effort

    def chat_constraint(req, thinking: bool, params: SamplingParams):
        """The request's Grammar (response_format json, tool_choice required/named/none), or None. A constrained
        turn may think for at most half of max_tokens, so that the constrained part always has room."""
        try:
            lark = chat_grammar(tokenizer, thinking=thinking, tools=req.tools, tool_choice=req.tool_choice,
                                parallel_tool_calls=req.parallel_tool_calls, response_format=req.response_format,
                                think_budget=max(1, params.max_tokens // 2))
            if lark is None:
                return None
            if lark not in grammars:
                param = "response_format" if req.response_format else "tools"
                grammars[lark] = Grammar(tokenizer, lark, param)
                while len(grammars) > 64:
                    grammars.popitem(last=False)
            grammars.move_to_end(lark)
            return grammars[lark]
        except GrammarError as e:
            raise APIError(400, str(e), e.param)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        check_model(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens,
                                 (req.top_logprobs or 0) if req.logprobs else None)
        thinking, effort = chat_thinking(req)
        images, media = image_collector()
        try:
            ids, turn_ends = render_chat(tokenizer, req.messages, media=media, tools=req.tools, thinking=thinking,
                                         thinking_effort=effort, tool_choice=req.tool_choice,
                                         response_format=req.response_format)
        except ValueError as e:
            word = str(e).split(" ", 1)[0].rstrip(":")
            param = next((f for f in ("messages", "tools", "tool_choice", "response_format") if word.startswith(f)),
                         "messages")
            raise APIError(400, str(e), param)
        params.grammar = chat_constraint(req, thinking, params)
        if params.grammar is not None and req.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with a constrained output (response_format json, "
                                "tool_choice required, none or a named function)", "ignore_eos")
        check_prompt(ids, params, images)
        cid, model = f"chatcmpl-{uuid.uuid4().hex}", model_name

        def new_parser():
            return OutputParser(tokenizer, req.tools, thinking=thinking)

        def finish_reason(out, parser) -> str | None:
            if not out.finished:
                return None
            return "tool_calls" if out.finish_reason == "stop" and parser.has_tool_calls else out.finish_reason

        def lp_content(lps):
            if not req.logprobs:
                return None
            return {"content": [{"token": tokenizer.decode([lp.token_id]), "logprob": lp.logprob, "bytes": None,
                                 "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": v, "bytes": None}
                                                  for t, v in lp.top]} for lp in lps]}

        if req.stream:
            async def events():
                parsers = [new_parser() for _ in range(req.n)]
                total, cache = 0, None
                base = {"id": cid, "object": "chat.completion.chunk", "model": model}
                for i in range(req.n):
                    yield sse({**base, "created": int(time.time()), "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
                async for i, out in run_choices(request, ids, params, req.n, turn_ends, images, req.policy_version):
                    total += len(out.new_token_ids)
                    cache = out.cache or cache
                    deltas = [parsers[i].feed(out.new_token_ids)]
                    if out.finished:
                        deltas.append(parsers[i].finish())
                    deltas = [d.to_openai() for d in deltas if d] or [{}]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        # with token ids on, every token is sent at once, even one that adds no text
                        if not (delta or (last and out.finished) or (req.return_token_ids and out.new_token_ids)):
                            continue
                        choice = {"index": i, "delta": delta, "logprobs": lp_content(out.new_logprobs) if k == 0
                                  else None, "finish_reason": finish_reason(out, parsers[i]) if last else None}
                        if req.return_token_ids:
                            choice["token_ids"] = list(out.new_token_ids) if k == 0 else []
                        yield sse({**base, "created": int(time.time()), "choices": [choice]})
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({**base, "created": int(time.time()), "choices": [],
                               "usage": usage(len(ids), total, cache), "k3_cache": cache.as_dict() if cache else None})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        finals, lps = await run_to_end(run_choices(request, ids, params, req.n, turn_ends, images, req.policy_version),
                                       req.n)
        if finals is None:  # client went away
            return error_response(499, "client closed request")
        choices = []
        for i in range(req.n):
            o, parser = finals[i], new_parser()
            parser.feed(o.output_ids)
            parser.finish()
            message = parser.message()
            message["reasoning_content"] = message["reasoning_content"] or None
            choices.append({"index": i, "message": message, "logprobs": lp_content(lps[i]),
                            "finish_reason": finish_reason(o, parser)})
            if req.return_token_ids:
                choices[-1].update(token_ids=list(o.output_ids), prompt_token_ids=list(ids))
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage(len(ids), sum(len(finals[i].output_ids) for i in finals),
                                                   finals[0].cache),
                "k3_cache": finals[0].cache.as_dict()}

    return app


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          engine_config=None, model_name: str | None = None, device: str = "cpu") -> None:
    """Load a model directory and serve it until Ctrl-C."""
    from pathlib import Path

    import uvicorn

    from k3.data import model_tokenizer
    from k3.vision.multimodal import load_model

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json there")
    tokenizer = model_tokenizer(d)
    model = load_model(d, device=device)  # a vision model when config.json has a vision_config
    engine = LLMEngine(model, tokenizer, engine_config)
    print(f"k3 serve: {engine.describe_capacity()}", flush=True)
    app = create_app(engine, tokenizer, model_name or d.name, api_key)
    uvicorn.run(app, host=host, port=port, log_level="warning")
