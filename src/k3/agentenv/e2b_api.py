"""The E2B control-plane routes and record shapes the official `e2b` SDK (2.x) expects, added to k3's own
control plane: `POST/GET /v2/sandboxes`, `POST /v2/sandboxes/{id}/connect` (resume), the SandboxDetail fields
(clientID, envdVersion, cpuCount, memoryMB, diskSizeMB, RFC 3339 times) and a per-sandbox envd access token.
The SDK's commands and files go to the host-side envd proxy (`k3.agentenv.envd`) on the same server."""
from __future__ import annotations

import datetime
import math
import secrets
import threading
from collections import OrderedDict
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from k3.agentenv.api import Limits

ENVD_VERSION = "0.5.7"  # the envd protocol level the proxy speaks (octet-stream uploads, close stdin)
CLIENT_ID = "k3"
CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1"  # e2b-code-interpreter's default template


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def e2b_fields(sb, m: dict) -> dict:
    """The SandboxDetail/ListedSandbox fields E2B's API adds to k3's record (times as RFC 3339)."""
    spec = getattr(sb, "spec", None)  # every backend's Sandbox has one; a stand-in may not
    limits = spec.limits if spec is not None else Limits()
    return {"clientID": CLIENT_ID, "envdVersion": ENVD_VERSION, "cpuCount": max(1, math.ceil(limits.cpus)),
            "memoryMB": limits.memory_bytes >> 20, "diskSizeMB": limits.disk_bytes >> 20,
            "startedAt": rfc3339(m["startedAt"]), "endAt": rfc3339(m["endAt"])}


class E2BCreateBody(BaseModel):
    """E2B's NewSandbox body: the fields k3 honours, and the ones it refuses by name when they ask for more."""
    model_config = ConfigDict(extra="forbid")
    templateID: str = "base"
    timeout: int = Field(300, gt=0, le=86400)
    autoPause: bool = False
    autoPauseMemory: bool | None = None
    metadata: dict[str, str] = {}
    envVars: dict[str, str] = {}
    secure: bool | None = None
    allowInternetAccess: bool | None = None
    allow_internet_access: bool | None = None  # the SDK's generated model sends this one in snake case


class E2BConnectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: int | None = Field(None, gt=0, le=86400)
    memory: bool | None = None


class EnvdTokens:
    """The access token of each sandbox's envd, handed out with create/connect and checked by the envd proxy.
    A gone sandbox's token is kept (so its holder hears 'not found', not 'unauthenticated'), the oldest
    dropped past `keep` entries."""

    def __init__(self, keep: int = 100_000):
        self._tokens: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.keep = keep

    def issue(self, sid: str) -> str:
        with self._lock:
            token = self._tokens.setdefault(sid, secrets.token_urlsafe(24))
            while len(self._tokens) > self.keep:
                self._tokens.popitem(last=False)
            return token

    def check(self, sid: str, got: str | None) -> bool:
        with self._lock:
            want = self._tokens.get(sid)
        return want is not None and got is not None and secrets.compare_digest(got.encode(), want.encode())


def mount_e2b(app: FastAPI, *, create, get, resume, set_ttl, info, boxes: dict, create_body, templates: dict,
              max_body_bytes: int) -> None:
    """Add E2B's v2 routes and the envd proxy to the control plane `app`. `create(body)`, `resume(sid)`,
    `get(sid)`, `info(sid)` are the control plane's own handlers; `create_body` its CreateBody model."""
    from k3.agentenv.envd import mount_envd

    tokens = EnvdTokens()
    app.state.envd_tokens = tokens

    def err(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"code": status, "message": message})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e):
        """A bad field is a 422 in E2B's error shape, naming the field (FastAPI's own is {"detail": [...]})."""
        where = ["/".join(str(p) for p in d.get("loc", ())) + ": " + d.get("msg", "") for d in e.errors()]
        return JSONResponse(status_code=422, content={"code": 422, "message": "; ".join(where)[:2000]})

    def created(sid: str) -> dict:
        return {"templateID": info(sid)["templateID"], "sandboxID": sid, "clientID": CLIENT_ID,
                "envdVersion": ENVD_VERSION, "envdAccessToken": tokens.issue(sid)}

    @app.post("/v2/sandboxes", status_code=201)
    def create_v2(body: E2BCreateBody):
        if body.allowInternetAccess or body.allow_internet_access:
            return err(400, "allowInternetAccess: k3 sandboxes have no outbound network (only a private loopback)")
        template = body.templateID
        if template == CODE_INTERPRETER_TEMPLATE and template not in templates:
            template = "base"  # e2b-code-interpreter's default: its kernel is served for every sandbox
        res = create(create_body(templateID=template, timeout=body.timeout, envVars=body.envVars,
                                 metadata=body.metadata, autoPause=body.autoPause))
        if isinstance(res, JSONResponse):
            return res
        return created(res["sandboxID"])

    @app.get("/v2/sandboxes")
    def list_v2(request: Request):
        q = request.query_params
        states = {s for v in q.getlist("state") for s in v.split(",") if s} or {"running", "paused"}
        wanted = dict(parse_qsl(q.get("metadata", "")))
        out = []
        for sid, sb in list(boxes.items()):
            if sb.state == "closed" or sb.state not in states:
                continue
            rec = info(sid)
            if template := q.get("template"):
                if rec["templateID"] != template:
                    continue
            if all(rec["metadata"].get(k) == v for k, v in wanted.items()):
                out.append(rec)
        out.sort(key=lambda r: r["startedAt"], reverse=q.get("order") != "asc")
        return out

    @app.post("/v2/sandboxes/{sid}/connect")
    def connect_v2(sid: str, body: E2BConnectBody | None = None):
        sb = get(sid)
        if sb.state == "paused":
            resume(sid)
        if body is not None and body.timeout is not None:
            set_ttl(sid, body.timeout)
        return created(sid)

    mount_envd(app, lookup=lambda sid: get(sid), tokens=tokens, max_body_bytes=max_body_bytes)
