"""`run_code` of `e2b-code-interpreter` (its `POST /execute` on port 49999, answered as JSON lines): a small
stateful Python kernel per sandbox, started inside the sandbox with k3's background spawn. The host writes
each cell as a file into the sandbox and streams the kernel's answer lines back. The kernel keeps one
globals dict (state carries from cell to cell, as in Jupyter), shows the value of a final expression as the
cell's result, and captures fds 1 and 2, so output of child processes is caught too. Python only."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading

from k3.agentenv.api import SandboxError

CELL_DIR = "/tmp/.k3-kernel"  # each kernel's cells go to CELL_DIR-<random>
POLL_SECONDS = 0.02
MAX_LINE = 4 << 20  # a longer answer line is dropped (the kernel's own lines are far smaller)

# Runs inside the sandbox (python3 -I -u -c). Protocol lines go to a private dup of the original stdout.
KERNEL = r'''
import ast, json, os, sys, threading, time, traceback
CELLS = sys.argv[1]
out = os.fdopen(os.dup(1), "w", buffering=1)
lock = threading.Lock()
def emit(**msg):
    with lock:
        out.write(json.dumps(msg) + "\n")
        out.flush()
MARK = "\x00k3-cell-end\x00\n"
done = {}
def pump(fd, kind):
    r = os.fdopen(fd, "r", errors="replace")
    buf = ""
    while True:
        chunk = r.readline()
        if not chunk:
            return
        buf += chunk
        if MARK in buf:
            head, _, rest = buf.partition(MARK)
            if head:
                emit(type=kind, text=head, timestamp=int(time.time() * 1e6))
            buf = rest
            done[kind].set()
        elif buf.endswith("\n"):
            emit(type=kind, text=buf, timestamp=int(time.time() * 1e6))
            buf = ""
for fd, kind in ((1, "stdout"), (2, "stderr")):
    r, w = os.pipe()
    os.dup2(w, fd)
    os.close(w)
    done[kind] = threading.Event()
    threading.Thread(target=pump, args=(r, kind), daemon=True).start()
sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
env = {"__name__": "__main__"}
n = 0
os.makedirs(CELLS)
emit(type="ready")
while True:
    path = os.path.join(CELLS, "cell-%d.py" % (n + 1))
    if not os.path.exists(path):
        time.sleep(0.01)
        continue
    n += 1
    with open(path) as f:
        code = f.read()
    os.unlink(path)
    emit(type="number_of_executions", execution_count=n)
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), env)
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), env) if last else None
        error = None
    except BaseException as e:
        value, error = None, e
    for kind, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        done[kind].clear()
        stream.write(MARK)
        stream.flush()
        done[kind].wait(5)
    if error is not None:
        emit(type="error", name=type(error).__name__, value=str(error),
             traceback="".join(traceback.format_exception(error)))
    elif value is not None:
        emit(type="result", text=repr(value), is_main_result=True)
    emit(type="end", cell=n)
'''


class Kernels:
    """One kernel per sandbox, started on its first cell; cells of one sandbox run one at a time."""

    def __init__(self):
        self._state: dict[str, dict] = {}  # sandbox id -> {"handle", "cells", "lock", "pending"}
        self._guard = threading.Lock()

    def _entry(self, sid: str) -> dict:
        with self._guard:
            return self._state.setdefault(sid, {"handle": None, "cells": 0, "lock": asyncio.Lock(),
                                                "pending": b""})

    def forget(self, sid: str) -> None:
        """Drop what is kept for a sandbox that is gone (its kernel went with it)."""
        with self._guard:
            self._state.pop(sid, None)

    async def run(self, sid: str, sb, code: str, timeout: float | None):
        """Yield the answer lines (dicts) of one cell."""
        st = self._entry(sid)
        async with st["lock"]:
            if st["handle"] is None or not await self._alive(sb, st):
                st["dir"] = f"{CELL_DIR}-{secrets.token_hex(6)}"  # its own: no other kernel reads these cells
                st["handle"] = await asyncio.to_thread(
                    sb.spawn, ["python3", "-I", "-u", "-c", KERNEL, st["dir"]], cwd="/workspace")
                st["cells"], st["pending"] = 0, b""
                async for msg in self._answers(sb, st, until="ready", timeout=30):
                    pass
            st["cells"] += 1
            await asyncio.to_thread(sb.write_file, f"{st['dir']}/cell-{st['cells']}.py", code.encode())
            finished = False
            try:
                async for msg in self._answers(sb, st, until="end", timeout=timeout):
                    yield msg
                finished = True
            finally:
                if not finished and st["handle"] is not None:  # the client left mid-cell: end that kernel
                    handle, st["handle"] = st["handle"], None
                    asyncio.get_running_loop().run_in_executor(None, sb.kill_process, handle)

    async def _alive(self, sb, st) -> bool:
        try:
            r = await asyncio.to_thread(sb.poll, st["handle"])
        except SandboxError:
            return False
        st["pending"] += r["stdout"]
        return r["running"]

    async def _answers(self, sb, st, until: str, timeout: float | None):
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            *lines, st["pending"] = st["pending"].split(b"\n")
            for raw in lines:
                try:
                    msg = json.loads(raw) if len(raw) <= MAX_LINE else None
                except ValueError:
                    msg = None
                if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                    continue  # not a kernel line (something the cell wrote to the protocol fd)
                if msg["type"] == until and (until == "ready" or msg.get("cell") == st["cells"]):
                    return
                if msg["type"] in ("stdout", "stderr", "result", "error", "number_of_executions"):
                    yield msg
            if deadline is not None and loop.time() > deadline:
                await self.stop(sb, st)
                raise TimeoutError(f"execution timed out after {timeout:g} s (the kernel was restarted)")
            try:
                r = await asyncio.to_thread(sb.poll, st["handle"])
            except SandboxError:
                r = {"stdout": b"", "running": False}
            st["pending"] += r["stdout"]
            if not r["running"] and not r["stdout"]:
                st["handle"] = None
                raise SandboxError("the kernel exited (its state is gone; the next cell starts a new one)")
            if not r["stdout"]:
                await asyncio.sleep(POLL_SECONDS)

    async def stop(self, sb, st) -> None:
        handle, st["handle"] = st["handle"], None
        if handle is not None:
            try:
                await asyncio.to_thread(sb.kill_process, handle)
            except SandboxError:
                pass


async def execute(scope, receive, send, *, sb, sid: str, kernels: Kernels) -> None:
    """`POST /execute` {code, language?, context_id?, env_vars?}: the kernel's lines as application/x-ndjson."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    request = Request(scope, receive)
    try:
        body = json.loads(await request.body())
        code = body.get("code")
        if not isinstance(code, str):
            raise ValueError("code: a string is required")
        if body.get("language") not in (None, "python"):
            raise ValueError(f"language: only python is offered, got {body.get('language')!r}")
        if body.get("context_id") not in (None, "default"):
            raise ValueError("context_id: only the default context is offered")
        if body.get("env_vars"):
            raise ValueError("env_vars: set them when creating the sandbox (envs=...)")
    except ValueError as e:
        return await JSONResponse(status_code=400, content={"code": 400, "message": str(e)})(scope, receive, send)
    timeout = request.headers.get("x-k3-timeout")  # none from the SDK: its own read timeout bounds a cell

    async def lines():
        try:
            async for msg in kernels.run(sid, sb, code, float(timeout) if timeout else None):
                yield json.dumps(msg) + "\n"
        except (TimeoutError, SandboxError) as e:
            yield json.dumps({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""}) + "\n"

    await StreamingResponse(lines(), media_type="application/x-ndjson")(scope, receive, send)
