"""An E2B-shaped HTTP control plane (FastAPI) over one backend: create/list/get/pause/resume/kill/fork
sandboxes, timeouts, exec and files. Binds to loopback only and requires a bearer token on every route."""
from __future__ import annotations

import base64
import secrets
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from k3.agentenv.api import Backend, Limits, Sandbox, SandboxError, SandboxSpec

MAX_SANDBOXES = 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateBody(_Body):
    templateID: str = "base"
    timeout: float = Field(300, gt=0, le=86400)  # seconds until the TTL action
    envVars: dict[str, str] = {}
    metadata: dict[str, str] = {}
    autoPause: bool = True
    memoryMB: int = Field(256, ge=16, le=65536)


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
                         token: str | None = None) -> FastAPI:
    """`templates`: {templateID: host dir or None}. `token` (generated when None) is in `app.state.token`."""
    token = token or secrets.token_urlsafe(24)
    templates = {"base": None, **(templates or {})}
    boxes: dict[str, Sandbox] = {}
    meta: dict[str, dict] = {}
    lock = threading.Lock()
    app = FastAPI(title="k3 agentenv")
    app.state.token, app.state.sandboxes = token, boxes

    def err(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"code": status, "message": message})

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {token}".encode()):
            return err(401, "missing or wrong bearer token")
        return await call_next(request)

    @app.exception_handler(SandboxError)
    async def _sb_error(request, e):
        return err(409, str(e))

    @app.exception_handler(ValueError)
    async def _value_error(request, e):
        return err(400, str(e))

    def info(sid: str) -> dict:
        sb, m = boxes[sid], meta[sid]
        return {"sandboxID": sid, "templateID": m["templateID"], "state": sb.state, "startedAt": m["startedAt"],
                "endAt": m["endAt"], "metadata": m["metadata"]}

    def get(sid: str) -> Sandbox:
        sb = boxes.get(sid)
        if sb is None or sb.state == "closed":
            raise KeyError(sid)
        return sb

    @app.exception_handler(KeyError)
    async def _missing(request, e):
        return err(404, f"sandbox {e.args[0]} not found")

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
        if sum(1 for s in boxes.values() if s.state != "closed") >= MAX_SANDBOXES:
            return err(429, f"at most {MAX_SANDBOXES} sandboxes")
        spec = SandboxSpec(template=templates[body.templateID], env=body.envVars, ttl=body.timeout,
                           on_expiry="pause" if body.autoPause else "kill", metadata=body.metadata,
                           limits=Limits(memory_bytes=body.memoryMB << 20))
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
        kids = parent.fork(body.count)
        m = meta[sid]
        return [register(k, m["templateID"], m["endAt"] - time.time(), m["metadata"]) for k in kids]

    @app.post("/sandboxes/{sid}/exec")
    def exec_(sid: str, body: ExecBody):
        r = get(sid).exec(body.cmd, cwd=body.cwd, env=body.envs, stdin=base64.b64decode(body.stdin),
                          timeout=body.timeout)
        return {"stdout": r.stdout.decode("utf-8", "replace"), "stderr": r.stderr.decode("utf-8", "replace"),
                "exitCode": r.exit_code, "signal": r.signal, "timedOut": r.timed_out, "truncated": r.truncated,
                "duration": r.duration}

    @app.get("/sandboxes/{sid}/files")
    def read(sid: str, path: str):
        return {"path": path, "data": base64.b64encode(get(sid).read_file(path)).decode()}

    @app.post("/sandboxes/{sid}/files", status_code=204)
    def write(sid: str, body: WriteBody):
        get(sid).write_file(body.path, base64.b64decode(body.data))
        return Response(status_code=204)

    @app.get("/sandboxes/{sid}/dir")
    def list_dir(sid: str, path: str = "/workspace"):
        return get(sid).list_dir(path)

    def close_all():
        for sb in list(boxes.values()):
            sb.close()
        boxes.clear()

    app.state.close_all = close_all
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
    print(f"k3 agentenv: http://{host}:{port} backend={backend_name} token={app.state.token}", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        app.state.close_all()
