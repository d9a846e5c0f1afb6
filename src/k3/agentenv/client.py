"""A small Python client of the control plane (httpx): the E2B-shaped routes, errors raised with the
server's message."""
from __future__ import annotations

import base64

import httpx


class ControlPlaneError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class AgentEnvClient:
    def __init__(self, base_url: str, token: str, timeout: float = 60.0):
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)

    def _req(self, method: str, path: str, **kw):
        r = self.http.request(method, path, **kw)
        if r.status_code >= 300:
            try:
                msg = r.json().get("message") or r.json().get("detail")
            except ValueError:
                msg = r.text
            raise ControlPlaneError(r.status_code, str(msg))
        return r.json() if r.content else None

    def create(self, template: str = "base", timeout: float = 300, env: dict | None = None,
               auto_pause: bool = False) -> dict:
        """`auto_pause`: pause at the timeout instead of being killed (E2B's default, and ours)."""
        return self._req("POST", "/sandboxes", json={"templateID": template, "timeout": timeout,
                                                      "envVars": env or {}, "autoPause": auto_pause})

    def list(self) -> list[dict]:
        return self._req("GET", "/sandboxes")

    def get(self, sid: str) -> dict:
        return self._req("GET", f"/sandboxes/{sid}")

    def kill(self, sid: str) -> None:
        self._req("DELETE", f"/sandboxes/{sid}")

    def pause(self, sid: str) -> None:
        self._req("POST", f"/sandboxes/{sid}/pause")

    def resume(self, sid: str) -> dict:
        return self._req("POST", f"/sandboxes/{sid}/resume")

    def set_timeout(self, sid: str, timeout: float) -> None:
        self._req("POST", f"/sandboxes/{sid}/timeout", json={"timeout": timeout})

    def fork(self, sid: str, count: int = 1) -> list[dict]:
        return self._req("POST", f"/sandboxes/{sid}/fork", json={"count": count})

    def exec(self, sid: str, cmd, timeout: float = 30, cwd: str = "/workspace", stdin: bytes = b"") -> dict:
        return self._req("POST", f"/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": timeout, "cwd": cwd,
                                                                 "stdin": base64.b64encode(stdin).decode()})

    def read_file(self, sid: str, path: str) -> bytes:
        return base64.b64decode(self._req("GET", f"/sandboxes/{sid}/files", params={"path": path})["data"])

    def write_file(self, sid: str, path: str, data: bytes) -> None:
        self._req("POST", f"/sandboxes/{sid}/files", json={"path": path, "data": base64.b64encode(data).decode()})

    def close(self) -> None:
        self.http.close()
