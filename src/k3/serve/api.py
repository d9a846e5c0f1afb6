"""OpenAI-compatible HTTP server (FastAPI), a drop-in for vLLM's: completions (batched prompts, echo, logprobs,
prompt logprobs), chat completions (SSE streaming), models, health/ping/version, Prometheus metrics,
tokenize/detokenize/tokenizer_info. Bodies are the models of k3.serve.protocol (documented in /openapi.json);
every bad request gets a 4xx JSON error in OpenAI's shape, and a stream that fails mid-way ends with an SSE error
event. Routes stay thin: parsing and preparation here, the shared submit → stream/collect path in
k3.serve.serving, the bodies in k3.serve.render.
/v1/chat/completions speaks K3's chat format (SPEC §1.2): `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format` (json_object, json_schema) enforced by a grammar (k3.serve.grammar), `tool_calls` and
`reasoning_content` (also as stream deltas), vLLM's `chat_template_kwargs` (thinking, thinking_effort) and
OpenAI's `reasoning_effort`. A field k3 does not know is a 400 naming it.
k3 extensions (all optional): `policy_version` (prefix-cache namespace), `return_token_ids` (generated ids per
choice and per streamed chunk, prompt ids per choice: raw-token continuation without re-tokenising), and on
/v1/completions `checkpoint_at` (prompt positions, e.g. tool-turn ends, worth a KDA checkpoint)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import secrets
import sys
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.data.chat_template import THINKING_EFFORTS
from k3.serve import gc_freeze
from k3.serve import protocol as P
from k3.serve.chat_template import render_chat
from k3.serve.engine import EngineThread, LLMEngine, fit_engine_config
from k3.serve.engine_process import EngineProcess
from k3.serve.grammar import Grammar, GrammarError, chat_grammar
from k3.serve.head_timeout import (HEADER_TIMEOUT_S, LIMIT_CONCURRENCY, fit_connection_limit,
                                   head_deadline_protocol)
from k3.serve.render import ChatRenderer, CompletionRenderer
from k3.serve.sampling import MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams
from k3.serve.serving import APIError, Job, LoopMailbox, Serving, error_response, mark_body, new_id, off_loop

MAX_REQUEST_BYTES = 64 << 20  # a 1M-token prompt as token ids is ~8 MB of JSON; images as data URLs add more
BODY_TIMEOUT_S = 30.0  # a client that takes longer to send its body is cut off (408): a slow client holds no worker
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/redoc",
                          "/docs/oauth2-redirect"})
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB89]|\\u[dD][c-fC-F]")


def check_api_key(key: str, where: str = "api_key") -> None:
    """A ValueError naming `where` unless `key` can be sent in an Authorization header: an empty key (an unset
    variable expanded: `--api-key "$KEY"`) would pass a bare 'Bearer ', and spaces, control or non-ASCII characters
    never arrive as sent (HTTP strips or refuses them), so no client could authenticate."""
    if not key:
        raise ValueError(f"{where} is empty: give a key, or leave it out (and $K3_API_KEY unset) to serve without one")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where} holds a space, control or non-ASCII character, which an Authorization header "
                         f"cannot carry: no client could send it")


class BearerAuth:
    """ASGI middleware: every route but the public probes (health, ping, version, metrics, the API docs) needs
    'Authorization: Bearer KEY'. Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware
    wraps `receive` so that the disconnect watcher (`serving._watch_disconnect`) never sees a disconnect."""

    def __init__(self, app, api_key: str):
        check_api_key(api_key)
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413, whether announced (Content-Length) or not."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            response = error_response(413, f"the request body exceeds {self.limit} bytes" if length.isdigit()
                                      else "Content-Length is not a number", code="request_too_large")
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise APIError(413, f"the request body exceeds {self.limit} bytes", code="request_too_large")
            return message
        await self.app(scope, counted, send)


async def _within(awaitable, timeout_s: float):
    """await awaitable, raising asyncio.TimeoutError after timeout_s. Not asyncio.wait_for before Python 3.12: it
    ran the awaitable as a task of its own, a hop that waits behind every stream's chunks under load (64 streams on a
    2-core VM: ~20 ms of each response head, benchmarks/bench_serve_frontend.py)."""
    if sys.version_info < (3, 11):  # (no asyncio.timeout)
        return await asyncio.wait_for(awaitable, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await awaitable


def _surrogate_path(obj, path: str) -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, which no tokenizer can encode."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            where = f"{path}.{k}" if path else str(k)
            if _surrogate_path(k, where) or _surrogate_path(v, where):
                return where
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (str, dict, list)) and (hit := _surrogate_path(v, f"{path}[{i}]")):
                return hit
    return None


def parse_body(raw: bytes, cls: type[BaseModel]):
    """JSON bytes → a validated request model, or an APIError (400) naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        if _SURROGATE_ESCAPE.search(raw) and (where := _surrogate_path(body, "")):
            param = re.split(r"[.\[]", where, maxsplit=1)[0]
            raise APIError(400, f"{where}: holds a lone UTF-16 surrogate (not valid Unicode text)", param)
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc)
        if err["type"] == "extra_forbidden":  # named in full: chat_template_kwargs.enable_thinking
            raise APIError(400, f"{where}: k3 does not support this field", where)
        raise APIError(400, f"{where}: {err['msg']}" if where else err["msg"], param)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply")


def _body_schema(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _responses(model: type[BaseModel], *errors: int, stream: type[BaseModel] | None = None) -> dict:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    ok: dict = {"description": "success", "content": {"application/json": {"schema": ref}}}
    if stream is not None:
        ok["description"] = (f"success; with stream: true, server-sent events whose data is a {stream.__name__} "
                             f"(an ErrorResponse if the request fails mid-stream), then [DONE]")
        # the schema of one event (OpenAPI 3.0/3.1 read `schema` as 3.2's itemSchema for text/event-stream);
        # its data is JSON text, described by contentSchema
        ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"$ref": f"#/components/schemas/{stream.__name__}"}},
            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}}
    out = {"200": ok}
    for status in errors:
        out[str(status)] = {"description": "error", "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return out


DOCUMENTED = (P.CompletionRequest, P.ChatRequest, P.TokenizeRequest, P.DetokenizeRequest, P.ErrorResponse,
              P.CompletionResponse, P.CompletionStreamChunk, P.ChatResponse, P.ChatStreamChunk, P.ModelList,
              P.ModelCard, P.TokenizeResponse, P.DetokenizeResponse, P.TokenizerInfo, P.Health, P.Version)


def create_app(engine: LLMEngine, tokenizer, model_name: str = "k3", api_key: str | None = None,
               max_tokens_limit: int | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, runner: EngineThread | None = None) -> FastAPI:
    """The FastAPI app around an engine (started and stopped with the app's lifespan): an LLMEngine, or an
    EngineProcess (the engine in a process of its own, which is its own runner); runner: the thread that drives an
    LLMEngine (default a plain EngineThread; distributed serving brings its own)."""
    if runner is None:
        runner = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
    max_len = engine.max_model_len
    max_tokens_limit = min(max_tokens_limit or max_len, max_len)
    engine.metrics.describe_model(model_name, max_len)
    serving = Serving(runner, engine.metrics)

    @asynccontextmanager
    async def lifespan(app):
        serving.mailbox = LoopMailbox(asyncio.get_running_loop())  # the server's loop
        runner.start()
        try:
            yield
        finally:
            runner.shutdown()

    app = FastAPI(title="k3 serve", version=_version(), lifespan=lifespan)
    app.state.runner, app.state.engine = runner, engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(status_code=e.status, content=e.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        response = error_response(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500
                                  else "server_error")
        response.headers.update(e.headers or {})  # e.g. a 405's Allow
        if e.status_code == 405:  # Starlette's Allow names one route's methods; a path may have several (/ping)
            path = request.url.path
            methods = {m for r in app.routes if getattr(r, "methods", None) and r.path_regex.match(path)
                       for m in r.methods}
            response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    @app.exception_handler(Exception)
    async def _server_error(request, e):
        if isinstance(e, RecursionError):  # a body nested past what its walkers (chat rendering, schemas) take
            return error_response(400, "request body is nested too deeply")
        return error_response(500, f"internal error: {type(e).__name__}", type_="server_error")

    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in DOCUMENTED],
                                         ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            if api_key is not None:  # say which routes want the key, so schema-driven clients (and fuzzers) send it
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in doc["paths"].items():
                    for operation in operations.values():
                        if path not in PUBLIC_PATHS:
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi

    async def read(request: Request, cls):
        try:
            raw = await _within(request.body(), body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body took longer than {body_timeout_s:g} s to arrive")
        mark_body(request, len(raw))
        return await off_loop(request, functools.partial(parse_body, raw, cls))  # a large body: off the loop

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", code="model_not_found")

    def sampling_params(req, max_tokens: int, logprobs=None, prompt_logprobs=None) -> SamplingParams:
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens must be at most {max_tokens_limit}, got {max_tokens}", "max_tokens")
        bias = None
        if req.logit_bias:
            if not all(k.isascii() and k.isdigit() and len(k) < 12 for k in req.logit_bias):
                raise APIError(400, "logit_bias: keys must be token ids (integers as strings)", "logit_bias")
            bias = {int(k): v for k, v in req.logit_bias.items()}
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > P.MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {P.MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        # below vLLM's sampling epsilon a temperature is greedy (a float32 division by it would overflow)
        temperature = 0.0 if req.temperature < 1e-5 else req.temperature
        fields = dict(max_tokens=max_tokens, temperature=temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                      seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                      ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, min_p=req.min_p,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, logit_bias=bias)
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            param = str(e).split(" ", 1)[0].rstrip(":")
            raise APIError(400, str(e), param if param in fields else None)

    def image_collector():
        """(list the images land in, media callback for render_chat, or None for a text-only model)."""
        vision = engine.vision_config
        images: list = []
        if vision is None:
            return images, None
        from k3.vision.multimodal import image_token_ids
        from k3.vision.preprocess import decode_data_url, preprocess_image

        def media(url: str, where: str) -> list[int]:
            try:  # the bytes of a data URL only: `preprocess_image` also reads files, which a client must not name
                im = preprocess_image(decode_data_url(url), vision)
            except ValueError as e:  # ImageError: bad data URL, remote URL, corrupt or absurd image
                raise ValueError(f"{where}: {e}") from None
            images.append(im)
            return image_token_ids(tokenizer, im)
        return images, media

    def check_prompts(prompts: list[list[int]], params: SamplingParams, images=None) -> None:
        for j, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{j}]"
            if not ids:
                raise APIError(400, f"{where} is empty", "prompt")
            try:
                engine.check_request(ids, params, images)
            except ValueError as e:
                field = str(e).split(" ", 1)[0].rstrip(":")
                raise APIError(400, f"{where}: {e}" if field == "prompt" else str(e),
                               field if field in _SAMPLING_FIELDS else "prompt")

    def check_prompt_logprobs(prompts: list[list[int]], k: int | None, req) -> None:
        """Every choice scores its prompt: the request's prompt tokens × n × (k+1) entries must stay within
        MAX_PROMPT_LOGPROB_ENTRIES (the host memory they take; see sampling.py)."""
        if k is None:
            return
        entries = sum(len(p) for p in prompts) * req.n * (k + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            param = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
            raise APIError(400, f"{param}: scoring {sum(len(p) for p in prompts)} prompt tokens × n={req.n} with "
                                f"top {k} would keep {entries} logprobs (tokens × n × (k+1)); at most "
                                f"{MAX_PROMPT_LOGPROB_ENTRIES} per request: ask for fewer or score shorter prompts",
                           param)

    # ---- probes, models, tokenizer ------------------------------------------------------------------------
    @app.get("/health", responses=_responses(P.Health, 503))
    async def health():
        if runner.error is not None:
            return error_response(503, f"engine failed: {runner.error}", type_="server_error")
        return {"status": "ok"}

    @app.get("/ping", responses=_responses(P.Health, 503))
    async def ping():
        return await health()

    @app.post("/ping", responses=_responses(P.Health, 503))
    async def ping_post():  # vLLM (SageMaker's probe) answers both
        return await health()

    @app.get("/version", responses=_responses(P.Version))
    async def version():
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        # (an engine in its own process is asked for it: off the loop)
        body, content_type = await asyncio.to_thread(engine.metrics.render, engine, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3", "root": model_name,
                "max_model_len": max_len}

    @app.get("/v1/models", responses=_responses(P.ModelList, 401))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=_responses(P.ModelCard, 401, 404))
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize", openapi_extra=_body_schema("TokenizeRequest"),
              responses=_responses(P.TokenizeResponse, 400, 401))
    async def tokenize(request: Request):
        req = await read(request, P.TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")

        def run():
            if req.prompt is not None:
                return tokenizer.encode(req.prompt)
            try:
                return render_chat(tokenizer, req.messages, req.add_generation_prompt, media=image_collector()[1])[0]
            except ValueError as e:
                raise APIError(400, str(e), "messages")
        ids = await asyncio.to_thread(run)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize", openapi_extra=_body_schema("DetokenizeRequest"),
              responses=_responses(P.DetokenizeResponse, 400, 401))
    async def detokenize(request: Request):
        req = await read(request, P.DetokenizeRequest)
        try:
            return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}
        except (ValueError, OverflowError) as e:
            raise APIError(400, f"tokens: {e}", "tokens")

    @app.get("/tokenizer_info", responses=_responses(P.TokenizerInfo, 401))
    async def tokenizer_info():
        return _tokenizer_info(tokenizer, max_len)

    # ---- completions ----------------------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"),
              responses=_responses(P.CompletionResponse, 400, 401, 404, 413, stream=P.CompletionStreamChunk))
    async def completions(request: Request):
        req = await read(request, P.CompletionRequest)
        check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported (k3 does not insert text)", "suffix")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise APIError(400, f"best_of: only 1 or n ({req.n}) is supported (k3 returns every candidate, it does "
                                f"not rank them); got {req.best_of}", "best_of")
        raw = req.prompt
        prompts = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) or raw == [] else list(raw)
        if len(prompts) > P.MAX_PROMPTS:
            raise APIError(400, f"prompt: at most {P.MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        if len(prompts) * req.n > P.MAX_CHOICES:
            raise APIError(400, f"n: prompts × n must be at most {P.MAX_CHOICES}, got {len(prompts) * req.n}", "n")
        if req.echo and req.logprobs is not None or req.prompt_logprobs is not None:
            prompt_k = max(req.logprobs or 0 if req.echo else 0, req.prompt_logprobs or 0)
        else:
            prompt_k = None
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = sampling_params(req, max_tokens, req.logprobs, prompt_k)
        ckpt = req.checkpoint_at

        def prepare():  # tokenising a long prompt takes seconds: never on the event loop
            ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
            check_prompt_logprobs(ids, prompt_k, req)
            check_prompts(ids, params)
            if ckpt is not None and not all(0 <= c <= len(i) for c in ckpt for i in ids):
                raise APIError(400, "checkpoint_at: positions must lie in the prompt", "checkpoint_at")
            texts = [p if isinstance(p, str) else tokenizer.decode(i) for p, i in zip(prompts, ids)] if req.echo \
                else ["" for _ in ids]
            return ids, texts
        ids, texts = await off_loop(request, prepare)
        job = Job(ids, params, req.n, [ckpt] * len(ids) if ckpt is not None else None, None, req.policy_version)
        renderer = CompletionRenderer(tokenizer, req, ids, texts, new_id("cmpl"), model_name)
        return await serving.respond(request, job, renderer, req.stream, _include_usage(req))

    # ---- chat -------------------------------------------------------------------------------------------------
    grammars: OrderedDict = OrderedDict()  # compiled constraints by grammar text (LRU): clients repeat schemas
    grammars_lock = threading.Lock()

    def chat_thinking(req) -> tuple[bool, str | None]:
        """(thinking on, thinking effort) from vLLM's chat_template_kwargs and OpenAI's reasoning_effort."""
        kw = req.chat_template_kwargs or P.ChatTemplateKwargs()
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
            with grammars_lock:
                grammar = grammars.get(lark)
                if grammar is not None:
                    grammars.move_to_end(lark)
                    return grammar
            grammar = Grammar(tokenizer, lark, "response_format" if req.response_format else "tools")
            with grammars_lock:
                grammars[lark] = grammar
                while len(grammars) > 64:
                    grammars.popitem(last=False)
            return grammar
        except GrammarError as e:
            raise APIError(400, str(e), e.param)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatRequest"),
              responses=_responses(P.ChatResponse, 400, 401, 404, 413, stream=P.ChatStreamChunk))
    async def chat(request: Request):
        req = await read(request, P.ChatRequest)
        check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        thinking, effort = chat_thinking(req)

        def prepare():  # rendering (and tokenising) a long chat, compiling a grammar: never on the event loop
            images, media = image_collector()
            try:
                ids, turn_ends = render_chat(tokenizer, req.messages, media=media, tools=req.tools, thinking=thinking,
                                             thinking_effort=effort, tool_choice=req.tool_choice,
                                             response_format=req.response_format)
            except ValueError as e:
                word = str(e).split(" ", 1)[0].rstrip(":")
                param = next((f for f in ("messages", "tools", "tool_choice", "response_format")
                              if word.startswith(f)), "messages")
                raise APIError(400, str(e), param)
            asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            max_tokens = asked if asked is not None else max(1, min(max_tokens_limit, 512, max_len - len(ids)))
            params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
            params.grammar = chat_constraint(req, thinking, params)
            if params.grammar is not None and req.ignore_eos:
                raise APIError(400, "ignore_eos cannot be combined with a constrained output (response_format json, "
                                    "tool_choice required, none or a named function)", "ignore_eos")
            check_prompts([ids], params, images)
            return ids, turn_ends, images, params
        # (a grammar's first compile may take long: off the loop)
        ids, turn_ends, images, params = await off_loop(request, prepare, inline=req.response_format is None
                                                        and not req.tools and req.tool_choice is None)
        job = Job([ids], params, req.n, [turn_ends], images, req.policy_version)
        renderer = ChatRenderer(tokenizer, req, ids, thinking, new_id("chatcmpl"), model_name)
        return await serving.respond(request, job, renderer, req.stream, _include_usage(req))

    return app


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _version() -> str:
    from k3 import __version__
    return __version__


def _tokenizer_info(tokenizer, max_len: int) -> dict:
    """vLLM's /tokenizer_info: the special tokens' texts and the Jinja chat template (lm-eval's remote tokenizer
    reads eos/bos/pad_token and chat_template)."""
    def text(token_id):
        return None if token_id is None else tokenizer.decode([token_id])
    try:
        from k3.data.tokenizer import CHAT_TEMPLATE_JINJA
        template = CHAT_TEMPLATE_JINJA.read_text()
    except (ImportError, OSError):
        template = None
    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": text(getattr(tokenizer, "bos_id", None)),
            "eos_token": text(getattr(tokenizer, "eos_id", None)),
            "pad_token": text(getattr(tokenizer, "pad_id", None)),
            "chat_template": template, "model_max_length": max_len, "vocab_size": tokenizer.vocab_size}


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          engine_config=None, model_name: str | None = None, device: str = "cpu",
          max_request_bytes: int = MAX_REQUEST_BYTES, timeout_keep_alive: float = 5.0,
          header_timeout: float = HEADER_TIMEOUT_S, limit_concurrency: int = LIMIT_CONCURRENCY,
          engine_process: bool = True) -> None:
    """Load a model directory and serve it until Ctrl-C. The engine's max_model_len defaults to the model's
    max_position_embeddings (capped by what the cache pool holds). header_timeout: seconds a connection may take
    to send a request head (slow or silent clients are cut off); limit_concurrency: open connections + running
    requests past which a request gets a 503 (lowered to what the open-files limit allows). engine_process: the
    engine loads and runs in a process of its own (k3.serve.engine_process); else on a thread of this one."""
    import functools
    from pathlib import Path

    import uvicorn

    from k3.data import model_tokenizer

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json there")
    tokenizer = model_tokenizer(d)
    build = functools.partial(load_engine, str(d), device, engine_config)
    t0 = time.perf_counter()
    if engine_process:
        engine = EngineProcess(build).start()
        made = engine.info["graphs"]
    else:
        engine = build()
        made = engine.warm_up()  # no request waits for a capture
    print(f"k3 serve: {engine.describe_capacity()}", flush=True)
    if made:
        print(f"k3 serve: {made} CUDA graphs captured (loaded and warm in {time.perf_counter() - t0:.1f} s)",
              flush=True)
    app = create_app(engine, tokenizer, model_name or d.name, api_key, max_request_bytes=max_request_bytes)
    gc_freeze.freeze()  # the model, engine and app: out of every later full collection
    uvicorn.run(app, **uvicorn_settings(host, port, timeout_keep_alive, header_timeout, limit_concurrency))


def load_engine(model_dir: str, device: str, engine_config) -> LLMEngine:
    """The engine `k3 serve` runs, in whichever process runs it: the model directory loaded onto device (a vision
    model when config.json has a vision_config; on a GPU MXFP4 experts stay packed: the MXFP4 kernels, a quarter
    of the bytes, as every --nproc rank keeps them; on a CPU dequantised experts run faster)."""
    import torch

    from k3.data import model_tokenizer
    from k3.vision.multimodal import load_model

    model = load_model(model_dir, device=device, keep_mxfp4=torch.device(device).type == "cuda")
    return LLMEngine(model, model_tokenizer(model_dir), fit_engine_config(model.config, engine_config))


def uvicorn_settings(host: str, port: int, timeout_keep_alive: float = 5.0, header_timeout: float = HEADER_TIMEOUT_S,
                     limit_concurrency: int = LIMIT_CONCURRENCY) -> dict:
    """uvicorn's keyword arguments for a k3 server: no client, slow, idle or many, holds it for long."""
    limit = fit_connection_limit(limit_concurrency)
    if limit < limit_concurrency:
        print(f"k3 serve: --limit-concurrency lowered to {limit} (the open-files limit)", flush=True)
    # keep-alive: an idle connection is closed after this many seconds; header_timeout: one that dawdles over a
    # request head (uvicorn has no such limit of its own); past `limit` connections or requests: 503
    return dict(host=host, port=port, log_level="warning", timeout_keep_alive=timeout_keep_alive,
                http=head_deadline_protocol(header_timeout), limit_concurrency=limit)
