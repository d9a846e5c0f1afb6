"""An ASGI app served by uvicorn on 127.0.0.1 (a free port) in a thread, for tests that speak HTTP."""
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def live_server(app, timeout: float = 20.0):
    """Yields the base URL; the server stops when the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + timeout
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(10)
        sock.close()
