"""The official `e2b` SDK (and `e2b-code-interpreter`'s Sandbox) drive `k3 agentenv serve` unmodified, set up
only through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY: lifecycle, commands (blocking, streamed, background,
kill) and files on a real bwrap sandbox; the envd proxy refuses other sandboxes' tokens, never hands a path to
a shell, and kills a command whose client went away."""
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")  # the dev extra installs it; the runtime install need not

from e2b import CommandExitException, Sandbox  # noqa: E402

from k3.agentenv import get_backend  # noqa: E402
from k3.agentenv.control_plane import create_control_plane  # noqa: E402
from k3.agentenv.envd import parse_upload  # noqa: E402
from k3.serve.local_server import local_server  # noqa: E402

KEY = "e2b-key-for-tests"
BODY_LIMIT = 4 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    b = get_backend("bwrap")
    ok, reason = b.available()
    if not ok:
        pytest.skip(f"backend unavailable: bwrap: {reason}")
    tpl = tmp_path_factory.mktemp("tpl")
    (tpl / "hello.txt").write_text("hi from the template")
    app = create_control_plane(b, {"hello": str(tpl)}, token=KEY, max_body_bytes=BODY_LIMIT)
    with local_server(app) as url:
        yield url, app
        app.state.close_all()


@pytest.fixture
def env(server, monkeypatch):
    url, app = server
    for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", KEY)):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return url, app


@pytest.fixture
def sbx(env):
    sb = Sandbox.create(template="hello", timeout=120, metadata={"suite": "e2b"})
    yield sb
    sb.kill()


def test_lifecycle_through_the_sdk(env):
    sb = Sandbox.create(template="hello", timeout=60, metadata={"run": "lifecycle"})
    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id and info.template_id == "hello" and info.state.value == "running"
    assert info.memory_mb == 256 and info.cpu_count == 1 and info.metadata == {"run": "lifecycle"}
    assert 55 <= (info.end_at - info.started_at).total_seconds() <= 61  # RFC 3339 times the SDK parsed
    listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"run": "lifecycle"})).next_items()
    assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
    assert Sandbox.list(query=e2b.SandboxQuery(metadata={"run": "other"})).next_items() == []

    before = sb.get_info().end_at
    sb.set_timeout(600)
    assert (sb.get_info().end_at - before).total_seconds() > 500

    sb.files.write("/workspace/state.txt", "survives pause")
    assert sb.pause() is True
    assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
    assert sb.is_running() is False  # envd of a paused sandbox does not answer
    paused = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
    assert sb.sandbox_id in [s.sandbox_id for s in paused]

    again = Sandbox.connect(sb.sandbox_id)  # resume
    assert again.get_info().state.value == "running" and again.is_running()
    assert again.files.read("/workspace/state.txt") == "survives pause"
    assert again.commands.run("cat hello.txt").stdout == "hi from the template"

    assert again.kill() is True
    assert again.is_running() is False
    with pytest.raises(e2b.SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(e2b.SandboxException):
        again.commands.run("true")
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_commands_blocking_streaming_background_kill(sbx):
    r = sbx.commands.run("echo out; echo err >&2; pwd; printf %s \"$GREETING\"", envs={"GREETING": "hello"})
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n/workspace\nhello", "err\n", 0)

    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo bad >&2; exit 3")
    assert e.value.exit_code == 3 and e.value.stderr == "bad\n"

    seen = []
    sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.3; done",
                     on_stdout=lambda s: seen.append((time.monotonic(), s)))
    assert [s for _, s in seen] == ["line1\n", "line2\n", "line3\n"]
    assert seen[-1][0] - seen[0][0] > 0.4  # delivered as produced, not all at the end

    h = sbx.commands.run("sleep 0.3; echo done", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.wait().stdout == "done\n"

    h = sbx.commands.run("sleep 30", background=True)
    t0 = time.monotonic()
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert time.monotonic() - t0 < 10 and e.value.error == "signal: killed"
    assert sbx.commands.kill(h.pid) is False  # gone


def test_client_timeout_kills_the_command(sbx):
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 2; touch /workspace/late", timeout=0.5)
    time.sleep(2.5)
    assert not sbx.files.exists("/workspace/late")


def test_files(sbx):
    info = sbx.files.write("/workspace/a/b.txt", "hello")  # parents are created, as envd does
    assert info.path == "/workspace/a/b.txt"
    assert sbx.files.read("/workspace/a/b.txt") == "hello"
    assert sbx.files.read("/workspace/a/b.txt", format="bytes") == bytearray(b"hello")
    blob = bytes(range(256)) * 1000
    sbx.files.write("/workspace/blob.bin", blob)
    assert bytes(sbx.files.read("/workspace/blob.bin", format="bytes")) == blob
    assert sbx.files.exists("/workspace/a/b.txt") and not sbx.files.exists("/workspace/nope")
    assert sbx.files.make_dir("/workspace/d") is True and sbx.files.make_dir("/workspace/d") is False
    entries = {e.name: e for e in sbx.files.list("/workspace")}
    assert {"a", "blob.bin", "d", "hello.txt"} <= set(entries)
    assert entries["d"].type.value == "dir" and entries["blob.bin"].size == len(blob)
    deep = {e.path for e in sbx.files.list("/workspace", depth=2)}
    assert "/workspace/a/b.txt" in deep
    assert sbx.files.get_info("/workspace/a/b.txt").size == 5
    sbx.files.remove("/workspace/a")
    assert not sbx.files.exists("/workspace/a/b.txt")
    with pytest.raises(e2b.NotFoundException):
        sbx.files.read("/workspace/a/b.txt")
    assert sbx.commands.run("ls /workspace/a || echo gone").stdout.strip().endswith("gone")


def test_paths_never_reach_a_shell(sbx):
    evil = "/workspace/$(touch /workspace/pwned);`touch /workspace/pwned2`"
    assert sbx.files.make_dir(evil) is True
    assert sbx.files.exists(evil)
    sbx.files.remove(evil)
    names = {e.name for e in sbx.files.list("/workspace")}
    assert "pwned" not in names and "pwned2" not in names


def test_envd_tokens_are_per_sandbox(env, sbx):
    url, app = env
    other = Sandbox.create(template="hello", timeout=60)
    try:
        tokens = app.state.envd_tokens
        own = tokens.issue(other.sandbox_id)
        h = {"E2b-Sandbox-Id": sbx.sandbox_id}
        assert httpx.get(url + "/health", headers=h).status_code == 401  # no token
        assert httpx.get(url + "/health", headers={**h, "X-Access-Token": own}).status_code == 401  # other's
        assert httpx.get(url + "/health", headers={**h, "X-API-KEY": KEY}).status_code == 401  # API key: no
        r = httpx.post(url + "/process.Process/List", json={}, headers={**h, "X-Access-Token": own})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        r = httpx.get(url + "/files", params={"path": "/workspace/hello.txt"},
                      headers={"E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": own})
        assert r.status_code == 200 and r.content == b"hi from the template"
    finally:
        other.kill()


def test_control_plane_needs_the_api_key(env):
    url, _ = env
    assert httpx.post(url + "/v2/sandboxes", json={"templateID": "hello"}).status_code == 401
    r = httpx.get(url + "/v2/sandboxes", headers={"X-API-KEY": "wrong"})
    assert r.status_code == 401 and set(r.json()) == {"code", "message"}
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create(template="hello", api_key="wrong")


def test_refusals_name_the_field(env):
    with pytest.raises(e2b.SandboxException, match="allowInternetAccess"):
        Sandbox.create(template="hello", allow_internet_access=True)
    with pytest.raises(e2b.SandboxException, match="no-such-template"):
        Sandbox.create(template="no-such-template")


def test_upload_body_is_bounded(sbx):
    # the server answers 413 and closes as soon as the limit is passed: a client still sending sees either that
    # answer (SandboxException) or the closed connection (a transport error), depending on timing
    with pytest.raises((e2b.SandboxException, httpx.TransportError)):
        sbx.files.write("/workspace/big.bin", b"x" * (BODY_LIMIT + 1))
    assert not sbx.files.exists("/workspace/big.bin")


def test_code_interpreter_sandbox_runs_commands_and_files(env):
    ci = pytest.importorskip("e2b_code_interpreter")
    sb = ci.Sandbox.create(template="hello", timeout=60)
    try:
        sb.files.write("/workspace/x.py", "print(6 * 7)")
        assert sb.commands.run("python3 x.py").stdout == "42\n"
    finally:
        assert sb.kill() is True


def test_code_interpreter_run_code(env):
    ci = pytest.importorskip("e2b_code_interpreter")
    sb = ci.Sandbox.create(timeout=60)  # its default template, code-interpreter-v1, runs as k3's base
    try:
        ex = sb.run_code("x = 6 * 7\nprint('hello')\nx")
        assert ex.results[0].text == "42" and ex.logs.stdout == ["hello\n"] and ex.error is None
        ex = sb.run_code("import subprocess, sys\nsubprocess.run(['echo', 'child'])\n"
                         "print('warn', file=sys.stderr)\nx + 1")  # state kept; a child's fd 1 is caught
        assert (ex.results[0].text, ex.logs.stdout, ex.logs.stderr) == ("43", ["child\n"], ["warn\n"])
        ex = sb.run_code("1 / 0")
        assert ex.error.name == "ZeroDivisionError" and "division by zero" in ex.error.traceback
        with pytest.raises(ci.TimeoutException):
            sb.run_code("import time\nwhile True: time.sleep(0.1)", timeout=1)
        assert sb.run_code("'fresh'").results[0].text == "'fresh'"  # a new kernel after the abandoned cell
        time.sleep(1)
        assert sb.commands.run("pgrep -fc 'k3-cell-en[d]'").stdout.strip() == "1"  # the old one was killed
        sb.run_code("k = 7")
        assert sb.pause() is True
        sb = ci.Sandbox.connect(sb.sandbox_id)
        assert sb.run_code("k").results[0].text == "7"  # the kernel's state survives pause and resume
    finally:
        sb.kill()


def test_fast_commands_report_their_exit_code(sbx):
    """A command whose pipes close just before it exits was once SIGKILLed and reported as signal 9."""
    assert [sbx.commands.run("true").exit_code for _ in range(15)] == [0] * 15


def test_parse_upload_multipart_and_octet_stream():
    req = httpx.Request("POST", "http://x/files", files=[("file", ("/w/a.txt", b"A")), ("file", ("/w/b", b"B\r\n"))])
    body = req.read()
    assert parse_upload(req.headers["content-type"], body, None) == [("/w/a.txt", b"A"), ("/w/b", b"B\r\n")]
    one = httpx.Request("POST", "http://x/files", files=[("file", ("ignored", b"\x00\xff"))])
    assert parse_upload(one.headers["content-type"], one.read(), "/w/c") == [("/w/c", b"\x00\xff")]
    assert parse_upload("application/octet-stream", b"raw", "/w/d") == [("/w/d", b"raw")]
    with pytest.raises(ValueError, match="path"):
        parse_upload("application/octet-stream", b"raw", None)
    with pytest.raises(ValueError, match="Content-Type"):
        parse_upload("text/plain", b"raw", "/w/e")


def test_list_depth_is_bounded(sbx):
    with pytest.raises(e2b.InvalidArgumentException, match="depth"):
        sbx.files.list("/workspace", depth=1000)


async def _async_round_trip():
    sb = await e2b.AsyncSandbox.create(template="hello", timeout=60)
    try:
        seen = []
        r = await sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=seen.append)
        await sb.files.write("/workspace/async.txt", "from asyncio")
        return r.stdout, seen, await sb.files.read("/workspace/async.txt"), await sb.is_running()
    finally:
        await sb.kill()


def test_async_sdk(env):
    import asyncio
    assert asyncio.run(_async_round_trip()) == ("a\nb\n", ["a\n", "b\n"], "from asyncio", True)


def test_without_the_e2b_package_the_control_plane_still_serves(monkeypatch):
    """`e2b` is a dev dependency only: without it the v2 routes are there and the envd proxy is off."""
    import sys

    from fastapi.testclient import TestClient

    monkeypatch.setitem(sys.modules, "e2b.envd.process.process_connect", None)  # import fails
    app = create_control_plane(get_backend("bwrap"), token=KEY)
    assert app.state.envd is None
    r = TestClient(app).get("/v2/sandboxes", headers={"X-API-KEY": KEY})
    assert r.status_code == 200 and r.json() == []
    assert TestClient(app).get("/health", headers={"X-API-KEY": KEY}).status_code == 404
