"""Serve an ASGI app (the OpenAI API, the AgentENV control plane) with uvicorn in a thread on a free loopback
port: what the benchmark and the HTTP tests need, without a second process."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


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
