"""An E2B-shaped HTTP control plane (FastAPI) over one backend: create/list/get/pause/resume/kill/fork
sandboxes, timeouts, exec and files. Binds to loopback only and requires a bearer token on every route.
Request bodies are bounded, every bad field is a 4xx, the sandbox cap holds under concurrent creates, and a
sandbox past its timeout is killed unless it asked for autoPause (E2B's defaults)."""
from __future__ import annotations

import base64
import binascii
import contextlib
import os
import secrets
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from k3.agentenv.api import Backend, Limits, Sandbox, SandboxError, SandboxSpec
from k3.agentenv.e2b_api import e2b_fields, mount_e2b

MAX_SANDBOXES = 64
MAX_BODY_BYTES = 100 << 20  # a 64 MiB file in base64 and its JSON fit


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) << 10
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def unbase64(data: str, field: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: not valid base64") from None


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, whether it declares its length or streams
    (chunked); what was received is never more than the limit plus one chunk."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> JSONResponse:
        return JSONResponse(status_code=413, content={"code": 413, "message":
                            f"request body larger than {self.max_bytes} bytes"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large()(scope, receive, send)
        seen, started, rejected = 0, False, False

        async def limited_receive():
            nonlocal seen, rejected
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:  # answer now; the app sees the client gone and its reply is dropped
                    if not started:
                        rejected = True
                        await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            nonlocal started
            if rejected:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, guarded_send)


class _CapReached(Exception):
    pass


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateBody(_Body):
    templateID: str = "base"
    timeout: float = Field(300, gt=0, le=86400)  # seconds until the TTL action
    envVars: dict[str, str] = {}
    metadata: dict[str, str] = {}
    autoPause: bool = False  # E2B's default: a sandbox past its timeout is killed
    memoryMB: int = Field(256, ge=16, le=1 << 20)


class TimeoutBody(_Body):
    timeout: float = Field(gt=0, le=86400)


class ForkBody(_Body):
    count: int = Field(1, ge=1, le=16)


class ExecBody(_Body):
    cmd: str | list[str]
    cwd: str = "/workspace"
    envs: dict[str, str] = {}
    timeout: float = Field(30, gt=0, le=3600)
    stdin: str = ""  # base64


class WriteBody(_Body):
    path: str
    data: str  # base64


def create_control_plane(backend: Backend, templates: dict[str, str | None] | None = None,
                         token: str | None = None, max_sandboxes: int = MAX_SANDBOXES,
                         max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """`templates`: {templateID: host dir or None}. `token` (generated when None) is in `app.state.token`."""
    token = token or secrets.token_urlsafe(24)
    templates = {"base": None, **(templates or {})}
    boxes: dict[str, Sandbox] = {}
    meta: dict[str, dict] = {}
    lock = threading.Lock()
    reserved = [0]  # slots of sandboxes being created right now (counted against the cap)
    app = FastAPI(title="k3 agentenv")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.state.token, app.state.sandboxes = token, boxes

    def err(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"code": status, "message": message})

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        got = request.headers.get("authorization", "")
        key = request.headers.get("x-api-key", "")  # what the official E2B SDK sends
        if not (secrets.compare_digest(got.encode(), f"Bearer {token}".encode())
                or secrets.compare_digest(key.encode(), token.encode())):
            return err(401, "missing or wrong bearer token (or X-API-KEY)")
        return await call_next(request)

    @app.exception_handler(SandboxError)
    async def _sb_error(request, e):
        return err(409, str(e))

    @app.exception_handler(ValueError)
    async def _value_error(request, e):
        return err(400, str(e))

    def info(sid: str) -> dict:
        sb, m = boxes[sid], meta[sid]
        return {"sandboxID": sid, "templateID": m["templateID"], "state": sb.state, "metadata": m["metadata"],
                **e2b_fields(sb, m)}  # E2B's SandboxDetail fields, times in RFC 3339

    def get(sid: str) -> Sandbox:
        sb = boxes.get(sid)
        if sb is None or sb.state == "closed":
            raise KeyError(sid)
        return sb

    @app.exception_handler(KeyError)
    async def _missing(request, e):
        return err(404, f"sandbox {e.args[0]} not found")

    @contextlib.contextmanager
    def slots(n: int):
        """Reserve `n` sandbox slots under the lock (the check and the claim are one step), or raise."""
        with lock:
            live = sum(1 for s in boxes.values() if s.state != "closed") + reserved[0]
            if live + n > max_sandboxes:
                raise _CapReached()
            reserved[0] += n
        try:
            yield
        finally:
            with lock:
                reserved[0] -= n

    @app.exception_handler(_CapReached)
    async def _cap(request, e):
        return err(429, f"at most {max_sandboxes} sandboxes")

    def register(sb: Sandbox, template_id: str, timeout: float, metadata: dict) -> dict:
        with lock:
            boxes[sb.id] = sb
            meta[sb.id] = {"templateID": template_id, "startedAt": time.time(), "endAt": time.time() + timeout,
                           "metadata": metadata}
        return info(sb.id)

    @app.post("/sandboxes", status_code=201)
    def create(body: CreateBody):
        if body.templateID not in templates:
            return err(404, f"template {body.templateID!r} not found; have {sorted(templates)}")
        if body.memoryMB << 20 > host_memory_bytes():
            return err(400, f"memoryMB={body.memoryMB} is more than this host has "
                            f"({host_memory_bytes() >> 20} MiB)")
        spec = SandboxSpec(template=templates[body.templateID], env=body.envVars, ttl=body.timeout,
                           on_expiry="pause" if body.autoPause else "kill", metadata=body.metadata,
                           limits=Limits(memory_bytes=body.memoryMB << 20))
        spec.validate()  # a bad field is a 400 before any slot or resource is taken
        with slots(1):
            return register(backend.create(spec), body.templateID, body.timeout, body.metadata)

    @app.get("/sandboxes")
    def list_():
        return [info(s) for s, sb in list(boxes.items()) if sb.state != "closed"]

    @app.get("/sandboxes/{sid}")
    def get_one(sid: str):
        get(sid)
        return info(sid)

    @app.delete("/sandboxes/{sid}", status_code=204)
    def kill(sid: str):
        get(sid).close()
        with lock:
            boxes.pop(sid, None)
            meta.pop(sid, None)
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/pause", status_code=204)
    def pause(sid: str):
        get(sid).pause()
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/resume")
    def resume(sid: str):
        get(sid).resume()
        return info(sid)

    @app.post("/sandboxes/{sid}/timeout", status_code=204)
    def set_timeout(sid: str, body: TimeoutBody):
        get(sid).set_ttl(body.timeout)
        meta[sid]["endAt"] = time.time() + body.timeout
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/fork", status_code=201)
    def fork(sid: str, body: ForkBody):
        parent = get(sid)
        with slots(body.count):
            kids = parent.fork(body.count)
        m = meta[sid]
        return [register(k, m["templateID"], m["endAt"] - time.time(), m["metadata"]) for k in kids]

    @app.post("/sandboxes/{sid}/exec")
    def exec_(sid: str, body: ExecBody):
        r = get(sid).exec(body.cmd, cwd=body.cwd, env=body.envs, stdin=unbase64(body.stdin, "stdin"),
                          timeout=body.timeout)
        return {"stdout": r.stdout.decode("utf-8", "replace"), "stderr": r.stderr.decode("utf-8", "replace"),
                "exitCode": r.exit_code, "signal": r.signal, "timedOut": r.timed_out, "truncated": r.truncated,
                "duration": r.duration}

    @app.get("/sandboxes/{sid}/files")
    def read(sid: str, path: str):
        return {"path": path, "data": base64.b64encode(get(sid).read_file(path)).decode()}

    @app.post("/sandboxes/{sid}/files", status_code=204)
    def write(sid: str, body: WriteBody):
        get(sid).write_file(body.path, unbase64(body.data, "data"))
        return Response(status_code=204)

    @app.get("/sandboxes/{sid}/dir")
    def list_dir(sid: str, path: str = "/workspace"):
        return get(sid).list_dir(path)

    def close_all():
        for sb in list(boxes.values()):
            sb.close()
        boxes.clear()

    app.state.close_all = close_all
    mount_e2b(app, create=create, get=get, resume=resume, info=info, boxes=boxes, create_body=CreateBody,
              templates=templates, set_ttl=lambda sid, t: set_timeout(sid, TimeoutBody(timeout=t)),
              max_body_bytes=max_body_bytes)
    return app


def serve(backend_name: str = "bwrap", host: str = "127.0.0.1", port: int = 49982,
          templates: dict[str, str | None] | None = None, token: str | None = None) -> None:
    """Run the control plane until Ctrl-C (loopback only)."""
    import uvicorn

    from k3.agentenv.api import get_backend

    if host not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError(f"host must be a loopback address (127.0.0.1, ::1, localhost), got {host!r}")
    backend = get_backend(backend_name)
    backend.require()
    app = create_control_plane(backend, templates, token)
    shown = "(as given)" if token else app.state.token  # a generated one is printed once, a given one never
    print(f"k3 agentenv: http://{host}:{port} backend={backend_name} token={shown}", flush=True)
    url = f"http://{'[::1]' if host == '::1' else host}:{port}"
    print(f"E2B SDK: E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY=<the token>" if app.state.envd else
          "E2B SDK: control-plane routes only (commands and files need `pip install e2b` on this host)", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        app.state.close_all()
