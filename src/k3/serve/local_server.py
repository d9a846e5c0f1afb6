"""Serve an ASGI app (the OpenAI API, the AgentENV control plane) with uvicorn in a thread on a free loopback
port: what the benchmark and the HTTP tests need, without a second process (`local_server`); or `k3 serve` itself
in a process of its own, as a user starts it (`serve_process`: the tests that drive it with outside tools, and the
benchmarks of several ranks)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def local_server(app, timeout: float = 20.0, as_k3_serve: bool = False, **settings):
    """Yields the base URL `http://127.0.0.1:PORT`; the server stops when the block ends. `as_k3_serve`: uvicorn
    configured as `k3 serve` configures it (k3.serve.api.uvicorn_settings: its HTTP protocol with the head deadline
    and the connection-close watch, keep-alive, concurrency limit); `settings` go to uvicorn.Config on top."""
    import uvicorn

    if as_k3_serve:
        from k3.serve.api import uvicorn_settings
        served = {k: v for k, v in uvicorn_settings("127.0.0.1", 0).items() if k not in ("host", "port")}
        settings = {**served, **settings}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **settings}))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the local server failed to start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(30)
        sock.close()


def free_port() -> int:
    """A loopback port free at the time of asking (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, alive, timeout: float, last_output) -> None:
    """Poll `url`/health until it answers 200; raise RuntimeError with `last_output()` (the servers' logs) when
    `alive()` turns false or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    while True:
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"k3 serve did not start: {last_output()}")
        try:
            with direct.open(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)


@contextmanager
def serve_process(model_dir, log_path, *args: str, timeout: float = 180.0, env: dict | None = None):
    """`k3 serve --model DIR --port P *args` in a process of its own (its output to log_path), on a free loopback
    port; yields its base URL once /health answers, and stops it (SIGTERM, SIGKILL after 30 s) when the block
    ends. A failed start raises with the end of the server's log. `env`: on top of this process's."""
    log_path = Path(log_path)
    for attempt in range(3):  # the free port can be taken before the server binds it (by any process): a new one
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--model", str(model_dir), "--port",
                                     str(port), *args], env={**os.environ, **(env or {})}, stdout=log,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(url, lambda: proc.poll() is None, timeout,
                               lambda: log_path.read_text(errors="replace")[-2000:])
            break
        except BaseException as e:  # (an interrupt while waiting too: the server must not outlive its caller)
            _stop(proc)
            if attempt == 2 or not (isinstance(e, RuntimeError) and "address already in use" in str(e)):
                raise
    try:
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
