"""Serve an ASGI app (the OpenAI API, the AgentENV control plane) with uvicorn in a thread on a free loopback
port: what the benchmark and the HTTP tests need, without a second process."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


@contextmanager
def local_server(app, timeout: float = 20.0, **settings):
    """Yields the base URL `http://127.0.0.1:PORT`; the server stops when the block ends. `settings` go to
    uvicorn.Config (e.g. `http=`: the protocol `k3 serve` uses, head_timeout.head_deadline_protocol)."""
    import uvicorn

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
