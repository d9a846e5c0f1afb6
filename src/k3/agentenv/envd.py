"""A host-side envd proxy: E2B's in-sandbox daemon protocol (Connect-RPC `process.Process` and
`filesystem.Filesystem`, `GET/POST /files`, `/health`) served by the control plane for every sandbox, routed by
the SDK's `E2b-Sandbox-Id` header and checked against that sandbox's envd access token (`X-Access-Token`).

Each call becomes one of k3's own sandbox operations (spawn/poll/kill, read/write/list, or a fixed argv run
inside the sandbox), so nothing new runs inside the sandbox and its isolation is unchanged. The Connect framing
and messages are `connectrpc` and the protobuf classes generated from E2B's own .proto files, as shipped in the
`e2b` package (needed only for this route; without it `k3 agentenv serve` keeps its k3 routes)."""
from __future__ import annotations

import asyncio
import datetime
import email.parser
import email.policy
import json
import posixpath
import signal
import stat as statmod
import threading
import time

from k3.agentenv.api import SandboxError

ENVD_HTTP_PATHS = ("/files", "/health")
POLL_SECONDS = 0.03       # how often a running command's output is collected
KEEPALIVE_SECONDS = 20.0  # an idle command stream sends a keepalive event so proxies and clients keep it open
MAX_DEPTH = 8             # ListDir depth bound (each level is one list call)


def _pb():
    """E2B's generated message modules (imported on use: the e2b package is optional)."""
    from e2b.envd.filesystem import filesystem_pb
    from e2b.envd.process import process_pb
    return process_pb, filesystem_pb


def rpc_error(code: str, message: str):
    """A Connect error with code `code` (a connectrpc Code name, e.g. 'NOT_FOUND')."""
    from connectrpc.code import Code
    from connectrpc.errors import ConnectError
    return ConnectError(Code[code], message)


class SandboxGone(Exception):
    """The sandbox named by E2b-Sandbox-Id is not running: `closed` (killed, timed out, never existed) or
    paused."""

    def __init__(self, message: str, closed: bool):
        super().__init__(message)
        self.closed = closed


def sandbox_for(headers, lookup, tokens):
    """The sandbox a request is for, after checking its envd access token. Raises PermissionError or
    SandboxGone (the message says 'was not found', as E2B's proxy does)."""
    sid = headers.get("e2b-sandbox-id") or ""
    if not tokens.check(sid, headers.get("x-access-token")):
        raise PermissionError("missing or wrong X-Access-Token for this sandbox")
    try:
        sb = lookup(sid)
    except KeyError:
        raise SandboxGone(f"sandbox {sid} was not found", closed=True) from None
    if sb.state != "running":
        raise SandboxGone(f"sandbox {sid} is {sb.state}: port is not open", closed=False)
    return sid, sb


def connect_error(e: Exception):
    """A k3 failure as the Connect error E2B's SDK maps to its own exceptions."""
    from connectrpc.errors import ConnectError
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, PermissionError):
        return rpc_error("UNAUTHENTICATED", str(e))
    if isinstance(e, SandboxGone):
        return rpc_error("UNAVAILABLE", str(e))
    msg = str(e)
    if "No such file" in msg or "not found" in msg or "FileNotFound" in msg:
        return rpc_error("NOT_FOUND", msg)
    if isinstance(e, (ValueError, SandboxError)):
        return rpc_error("INVALID_ARGUMENT", msg)
    return rpc_error("INTERNAL", f"{type(e).__name__}: {msg}")


def entry_from_stat_line(path: str, line: str):
    """EntryInfo from `stat -c '%f|%s|%U|%G|%Y|%N'` (raw mode in hex, size, owner, group, mtime, name)."""
    _, fs = _pb()
    from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
    raw_mode, size, owner, group, mtime, _ = line.split("|", 5)
    mode = int(raw_mode, 16)
    kind = (fs.FileType.DIRECTORY if statmod.S_ISDIR(mode) else
            fs.FileType.SYMLINK if statmod.S_ISLNK(mode) else fs.FileType.FILE)
    return fs.EntryInfo(name=posixpath.basename(path.rstrip("/")) or "/", type=kind, path=path, size=int(size),
                        mode=statmod.S_IMODE(mode), permissions=statmod.filemode(mode), owner=owner, group=group,
                        modified_time=Timestamp.from_datetime(
                            datetime.datetime.fromtimestamp(int(mtime), datetime.timezone.utc)),
                        is_symlink=statmod.S_ISLNK(mode))


def absolute(path: str) -> str:
    return posixpath.normpath(path if path.startswith("/") else posixpath.join("/workspace", path))


def run_argv(sb, argv: list[str]) -> str:
    """Run a fixed argv inside the sandbox (as its own user); its stderr is the error on failure. The sandbox's
    shell looks the program up on PATH; the arguments stay separate words (never parsed by the shell)."""
    r = sb.exec(["/bin/sh", "-c", 'exec "$@"', "sh", *argv], timeout=30)
    if r.exit_code != 0:
        raise SandboxError((r.stderr or r.stdout).decode("utf-8", "replace").strip() or f"{argv[0]} failed")
    return r.stdout.decode("utf-8", "replace")


def stat_entry(sb, path: str):
    path = absolute(path)
    return entry_from_stat_line(path, run_argv(sb, ["stat", "-c", "%f|%s|%U|%G|%Y|%N", "--", path]).strip())


class ProcessService:
    """`process.Process`: commands started with k3's background spawn, their output streamed as it comes."""

    def __init__(self, lookup, tokens):
        self.lookup, self.tokens = lookup, tokens
        self.procs: dict[tuple[str, int], object] = {}  # (sandbox id, pid) -> the StartRequest's config
        self.lock = threading.Lock()

    def _sandbox(self, ctx):
        try:
            return sandbox_for(ctx.request_headers, self.lookup, self.tokens)
        except Exception as e:
            raise connect_error(e) from None

    async def start(self, request, ctx):
        pb, _ = _pb()
        from protobuf import Oneof
        sid, sb = self._sandbox(ctx)
        cfg = request.process
        if request.pty is not None:
            raise connect_error(ValueError("pty: k3 sandboxes have no terminals; run without a pty"))
        argv = [cfg.cmd, *cfg.args]
        try:
            handle = await asyncio.to_thread(sb.spawn, argv, cwd=absolute(cfg.cwd or "/workspace"),
                                             env=dict(cfg.envs))
        except Exception as e:
            raise connect_error(e) from None
        pid = int(handle)
        with self.lock:
            self.procs[(sid, pid)] = cfg

        def event(name, value):
            return pb.StartResponse(event=pb.ProcessEvent(event=Oneof(name, value)))

        yield event("start", pb.ProcessEvent.StartEvent(pid=pid))
        finished, last = False, time.monotonic()
        limit_ms = ctx.timeout_ms  # the command's timeout, sent by the SDK: past it the command is killed
        deadline = None if limit_ms is None else time.monotonic() + limit_ms / 1000
        try:
            running = True
            while True:
                try:
                    r = await asyncio.to_thread(sb.poll, handle)
                except SandboxError as e:
                    if not running:
                        break  # the guest already reported everything and dropped the handle
                    raise connect_error(e) from None
                got = False
                for name in ("stdout", "stderr"):
                    if r[name]:
                        got = True
                        yield event("data", pb.ProcessEvent.DataEvent(output=Oneof(name, r[name])))
                if not r["running"]:
                    end = r
                    if not got and not running:
                        break
                    running = False
                    continue  # one more poll collects what was still in the pipes
                if deadline is not None and time.monotonic() > deadline:
                    raise rpc_error("DEADLINE_EXCEEDED", f"command timed out after {limit_ms / 1000:g} s")
                if got:
                    last = time.monotonic()
                elif time.monotonic() - last > KEEPALIVE_SECONDS:
                    last = time.monotonic()
                    yield event("keepalive", pb.ProcessEvent.KeepAlive())
                await asyncio.sleep(POLL_SECONDS)
            finished = True
            if end.get("signal"):
                status = "signal: " + ("killed" if end["signal"] == signal.SIGKILL else
                                       signal.Signals(end["signal"]).name if end["signal"] in
                                       signal.valid_signals() else str(end["signal"]))
                yield event("end", pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status,
                                                            error=status))
            else:
                code = end.get("exit_code") or 0
                yield event("end", pb.ProcessEvent.EndEvent(exit_code=code, exited=True,
                                                            status=f"exit status {code}"))
        finally:
            with self.lock:
                self.procs.pop((sid, pid), None)
            if not finished:  # the client went away (its timeout, or it closed the stream): E2B kills it
                try:
                    await asyncio.to_thread(sb.kill_process, handle)
                except Exception:
                    pass

    async def list(self, request, ctx):
        pb, _ = _pb()
        sid, _sb = self._sandbox(ctx)
        with self.lock:
            mine = [(pid, cfg) for (s, pid), cfg in self.procs.items() if s == sid]
        return pb.ListResponse(processes=[pb.ProcessInfo(pid=pid, config=cfg) for pid, cfg in mine])

    async def send_signal(self, request, ctx):
        pb, _ = _pb()
        sid, sb = self._sandbox(ctx)
        sel = request.process.selector if request.process else None
        pid = sel.value if sel is not None and sel.field == "pid" else None
        with self.lock:
            known = (sid, pid) in self.procs
        if not known:
            raise rpc_error("NOT_FOUND", f"process {pid} not found")
        await asyncio.to_thread(sb.kill_process, str(pid))
        return pb.SendSignalResponse()

    async def close_stdin(self, request, ctx):
        pb, _ = _pb()
        self._sandbox(ctx)
        return pb.CloseStdinResponse()  # commands start with stdin closed: nothing is left to close

    async def connect(self, request, ctx):
        raise self._unsupported("Connect (re-attaching to a running command)")
        yield  # pragma: no cover

    async def update(self, request, ctx):
        raise self._unsupported("Update (pty resize)")

    async def stream_input(self, request, ctx):
        raise self._unsupported("StreamInput (stdin)")

    async def send_input(self, request, ctx):
        raise self._unsupported("SendInput (stdin)")

    def _unsupported(self, what):
        return rpc_error("UNIMPLEMENTED", f"k3 envd proxy: {what} is not supported")


class FilesystemService:
    """`filesystem.Filesystem`: list through k3's list op; stat, mkdir, remove, move as fixed argv runs."""

    def __init__(self, lookup, tokens):
        self.lookup, self.tokens = lookup, tokens

    async def _call(self, ctx, fn, *args):
        try:
            _sid, sb = sandbox_for(ctx.request_headers, self.lookup, self.tokens)
            return await asyncio.to_thread(fn, sb, *args)
        except Exception as e:
            raise connect_error(e) from None

    async def stat(self, request, ctx):
        _, fs = _pb()
        return fs.StatResponse(entry=await self._call(ctx, stat_entry, request.path))

    async def make_dir(self, request, ctx):
        _, fs = _pb()

        def make(sb, path):
            path = absolute(path)
            if sb.exec(["/bin/sh", "-c", 'test -e "$1"', "sh", path], timeout=30).exit_code == 0:
                raise rpc_error("ALREADY_EXISTS", f"{path} already exists")
            run_argv(sb, ["mkdir", "-p", "--", path])
            return stat_entry(sb, path)
        return fs.MakeDirResponse(entry=await self._call(ctx, make, request.path))

    async def remove(self, request, ctx):
        _, fs = _pb()

        def rm(sb, path):
            path = absolute(path)
            stat_entry(sb, path)  # a missing path is NOT_FOUND, as envd answers
            run_argv(sb, ["rm", "-rf", "--", path])
        await self._call(ctx, rm, request.path)
        return fs.RemoveResponse()

    async def move(self, request, ctx):
        _, fs = _pb()

        def mv(sb, src, dst):
            run_argv(sb, ["mv", "-T", "--", absolute(src), absolute(dst)])
            return stat_entry(sb, dst)
        return fs.MoveResponse(entry=await self._call(ctx, mv, request.source, request.destination))

    async def list_dir(self, request, ctx):
        _, fs = _pb()
        depth = request.depth or 1
        if not 1 <= depth <= MAX_DEPTH:
            raise rpc_error("INVALID_ARGUMENT", f"depth must be in [1, {MAX_DEPTH}], got {depth}")

        def walk(sb, path):
            out, todo = [], [(absolute(path), 1)]
            while todo:
                d, level = todo.pop()
                for e in sb.list_dir(d):
                    mode = e.get("mode", 0)
                    kind = {"dir": fs.FileType.DIRECTORY, "symlink": fs.FileType.SYMLINK}.get(e["type"],
                                                                                            fs.FileType.FILE)
                    out.append(fs.EntryInfo(name=e["name"], type=kind, path=e["path"], size=e.get("size", 0),
                                            mode=mode, permissions=statmod.filemode(mode | {
                                                "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(
                                                    e["type"], statmod.S_IFREG)),
                                            is_symlink=e["type"] == "symlink"))
                    if e["type"] == "dir" and level < depth:
                        todo.append((e["path"], level + 1))
            return out
        return fs.ListDirResponse(entries=await self._call(ctx, walk, request.path))

    def _unsupported(self, what):
        return rpc_error("UNIMPLEMENTED", f"k3 envd proxy: {what} is not supported")

    async def watch_dir(self, request, ctx):
        raise self._unsupported("WatchDir")
        yield  # pragma: no cover

    async def create_watcher(self, request, ctx):
        raise self._unsupported("CreateWatcher")

    async def get_watcher_events(self, request, ctx):
        raise self._unsupported("GetWatcherEvents")

    async def remove_watcher(self, request, ctx):
        raise self._unsupported("RemoveWatcher")


def parse_upload(content_type: str, body: bytes, path: str | None) -> list[tuple[str, bytes]]:
    """(path, data) pairs of an upload: an octet-stream body for `path`, or multipart/form-data parts named
    `file` whose filename is the path (the query's `path` wins for a single part). Parsed by the stdlib."""
    if content_type.split(";")[0].strip().lower() == "application/octet-stream":
        if not path:
            raise ValueError("path: an octet-stream upload needs ?path=")
        return [(path, body)]
    if not content_type.lower().startswith("multipart/form-data"):
        raise ValueError(f"Content-Type: expected multipart/form-data or application/octet-stream, "
                         f"got {content_type!r}")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        raise ValueError("multipart body could not be parsed")
    parts = [(p.get_filename(), p.get_payload(decode=True) or b"") for p in msg.iter_parts()]
    if len(parts) == 1 and path:
        return [(path, parts[0][1])]
    for name, _ in parts:
        if not name:
            raise ValueError("a multipart part has no filename (the file's path)")
    return parts


def mount_envd(app, *, lookup, tokens, max_body_bytes: int) -> None:
    """Serve envd's routes on `app`'s server in front of its middleware (their auth is the per-sandbox token,
    not the control plane's key). `lookup(sid)` returns a live Sandbox or raises KeyError."""
    try:
        from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
        from e2b.envd.process.process_connect import ProcessASGIApplication
    except ImportError:  # the e2b package (and its connectrpc) is not installed: k3's own routes only
        app.state.envd = None
        return
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from k3.agentenv.code_kernel import Kernels, execute
    from k3.agentenv.control_plane import BodyLimit

    rpc = {"/process.Process/": ProcessASGIApplication(ProcessService(lookup, tokens), read_max_bytes=1 << 20),
           "/filesystem.Filesystem/": FilesystemASGIApplication(FilesystemService(lookup, tokens),
                                                               read_max_bytes=1 << 20)}

    def err(status, message):
        return JSONResponse(status_code=status, content={"code": status, "message": message})

    async def files_and_health(scope, receive, send):
        request = Request(scope, receive)
        try:
            _sid, sb = sandbox_for(request.headers, lookup, tokens)
        except PermissionError as e:
            return await err(401, str(e))(scope, receive, send)
        except SandboxGone as e:
            return await err(502, str(e))(scope, receive, send)
        try:
            if scope["path"] == "/health":
                response = Response(status_code=204)
            elif request.method == "GET":
                path = request.query_params.get("path") or ""
                data = await asyncio.to_thread(sb.read_file, absolute(path))
                response = Response(data, media_type="application/octet-stream")
            elif request.method == "POST":
                uploads = parse_upload(request.headers.get("content-type", ""), await request.body(),
                                       request.query_params.get("path"))
                written = []
                for path, data in uploads:
                    await asyncio.to_thread(sb.write_file, absolute(path), data)
                    written.append({"name": posixpath.basename(path), "type": "file", "path": absolute(path)})
                response = Response(json.dumps(written), media_type="application/json")
            else:
                response = err(405, f"method {request.method} not allowed on {scope['path']}")
        except Exception as e:
            msg = str(e)
            status = 404 if ("No such file" in msg or "not found" in msg or isinstance(e, FileNotFoundError)) \
                else 400 if isinstance(e, (ValueError, SandboxError)) else 500
            response = err(status, msg)
        await response(scope, receive, send)

    http_app = BodyLimit(files_and_health, max_bytes=max_body_bytes)
    kernels = Kernels()

    async def run_code(scope, receive, send):
        try:
            sid, sb = sandbox_for(Request(scope, receive).headers, lookup, tokens)
        except PermissionError as e:
            return await err(401, str(e))(scope, receive, send)
        except SandboxGone as e:
            if e.closed:
                kernels.forget(Request(scope, receive).headers.get("e2b-sandbox-id", ""))
            return await err(502, str(e))(scope, receive, send)
        await execute(scope, receive, send, sb=sb, sid=sid, kernels=kernels)

    code_app = BodyLimit(run_code, max_bytes=max_body_bytes)

    class EnvdDispatch:
        """ASGI: envd paths go to the envd proxy, everything else to the control plane."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            path = scope.get("path", "") if scope["type"] == "http" else ""
            for prefix, target in rpc.items():
                if path.startswith(prefix):
                    return await target(scope, receive, send)
            if path in ENVD_HTTP_PATHS:
                return await http_app(scope, receive, send)
            if path == "/execute":  # e2b-code-interpreter's run_code (its port 49999)
                return await code_app(scope, receive, send)
            return await self.inner(scope, receive, send)

    app.add_middleware(EnvdDispatch)
    app.state.envd = rpc
