"""The control plane over HTTP on loopback: bearer token required, E2B-shaped lifecycle, exec and files
through the client; with an unavailable backend, create fails with the backend's reason."""
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from k3.agentenv import get_backend
from k3.agentenv.api import Backend, SandboxSpec
from k3.agentenv.client import AgentEnvClient, ControlPlaneError
from k3.agentenv.control_plane import create_control_plane
from k3.serve.local_server import free_port, local_server


class Unavailable(Backend):
    name = "nothing"

    def available(self):
        return False, "no namespaces on this machine"

    def create(self, spec=None):
        self.require()


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    b = get_backend("bwrap")
    ok, reason = b.available()
    tpl = tmp_path_factory.mktemp("tpl")
    (tpl / "hello.txt").write_text("hi")
    app = create_control_plane(b if ok else Unavailable(), {"hello": str(tpl)}, token="t0ken")
    with local_server(app) as url:
        yield url, ok, reason
        app.state.close_all()


def test_token_required(plane):
    url, _, _ = plane
    with pytest.raises(ControlPlaneError) as e:
        AgentEnvClient(url, "wrong").list()
    assert e.value.status == 401
    assert httpx.get(url + "/sandboxes").status_code == 401  # no header at all


def test_lifecycle_exec_files_fork(plane):
    url, ok, reason = plane
    c = AgentEnvClient(url, "t0ken")
    if not ok:
        with pytest.raises(ControlPlaneError, match="backend unavailable"):
            c.create("hello")
        pytest.skip(f"backend unavailable: bwrap: {reason}")
    with pytest.raises(ControlPlaneError) as e:
        c.create("no-such-template")
    assert e.value.status == 404
    sb = c.create("hello", timeout=60)
    sid = sb["sandboxID"]
    assert c.get(sid)["state"] == "running" and sid in [s["sandboxID"] for s in c.list()]
    assert c.read_file(sid, "hello.txt") == b"hi"
    r = c.exec(sid, "cat hello.txt; echo -n err >&2; exit 4")
    assert (r["stdout"], r["stderr"], r["exitCode"]) == ("hi", "err", 4)
    c.write_file(sid, "w.txt", b"data")
    kids = c.fork(sid, 2)
    c.write_file(kids[0]["sandboxID"], "w.txt", b"kid")
    assert c.read_file(kids[1]["sandboxID"], "w.txt") == b"data" and c.read_file(sid, "w.txt") == b"data"
    c.pause(sid)
    assert c.get(sid)["state"] == "paused"
    with pytest.raises(ControlPlaneError) as e:
        c.exec(sid, "true")
    assert e.value.status == 409
    assert c.resume(sid)["state"] == "running"
    for s in [sid] + [k["sandboxID"] for k in kids]:
        c.kill(s)
    with pytest.raises(ControlPlaneError) as e:
        c.get(sid)
    assert e.value.status == 404
    with pytest.raises(ControlPlaneError) as e:
        c.fork(sid, 99)
    assert e.value.status in (404, 422)


# ---- hostile requests -----------------------------------------------------------------------------------
def post(url, path, headers=None, **kw):
    return httpx.post(url + path, headers={"Authorization": "Bearer t0ken", **(headers or {})}, timeout=60, **kw)


def need_backend(plane):
    if not plane[1]:
        pytest.skip(f"backend unavailable: bwrap: {plane[2]}")


@pytest.mark.parametrize("body, field", [
    ({"envVars": {"BIG": "x" * (4 << 20)}}, "BIG"),
    ({"envVars": {"A": "b\0c"}}, "NUL"),
    ({"memoryMB": (1 << 20) - 1}, "memoryMB"),
    ({"timeout": -1}, "timeout"),
    ({"templateID": "hello", "unknown": 1}, "unknown"),
])
def test_bad_create_fields_are_4xx_and_create_nothing(plane, body, field):
    url, ok, _ = plane
    need_backend(plane)
    before = len(AgentEnvClient(url, "t0ken").list())
    r = post(url, "/sandboxes", json=body)
    assert 400 <= r.status_code < 500 and field in r.text, (r.status_code, r.text[:300])
    assert len(AgentEnvClient(url, "t0ken").list()) == before


def test_bad_exec_and_file_fields_are_4xx(plane):
    url, ok, _ = plane
    need_backend(plane)
    c = AgentEnvClient(url, "t0ken")
    sid = c.create("hello", timeout=60)["sandboxID"]
    try:
        r = post(url, f"/sandboxes/{sid}/files", json={"path": "w.txt", "data": "not base64!!"})
        assert r.status_code == 400 and "base64" in r.text
        assert "w.txt" not in [e["name"] for e in httpx.get(url + f"/sandboxes/{sid}/dir", headers={
            "Authorization": "Bearer t0ken"}).json()]  # nothing written, not even an empty file
        r = post(url, f"/sandboxes/{sid}/exec", json={"cmd": "cat", "stdin": "%%%"})
        assert r.status_code == 400 and "stdin" in r.text
        r = post(url, f"/sandboxes/{sid}/exec", json={"cmd": "true", "envs": {"A": "x\0y"}})
        assert r.status_code == 400 and "NUL" in r.text
        assert c.exec(sid, "echo fine")["stdout"] == "fine\n"  # and the sandbox is unharmed
    finally:
        c.kill(sid)


def test_timeout_kills_by_default_like_e2b(plane):
    url, ok, _ = plane
    need_backend(plane)
    c = AgentEnvClient(url, "t0ken")
    sid = c.create("hello", timeout=1)["sandboxID"]
    deadline = time.monotonic() + 15
    while sid in [s["sandboxID"] for s in c.list()]:
        assert time.monotonic() < deadline, c.get(sid)
        time.sleep(0.2)
    with pytest.raises(ControlPlaneError) as e:
        c.exec(sid, "true")
    assert e.value.status == 404
    paused = c.create("hello", timeout=1, auto_pause=True)["sandboxID"]  # autoPause keeps it, paused
    time.sleep(2)
    assert c.get(paused)["state"] == "paused"
    c.kill(paused)


class SlowBackend(Backend):
    """Creates take 0.2 s: a window in which a cap checked outside the lock lets every waiting create in."""
    name = "slow"

    def available(self):
        return True, ""

    def create(self, spec=None):
        time.sleep(0.2)
        return FakeSandbox()


class FakeSandbox:
    spec = SandboxSpec()

    def __init__(self):
        self.id, self.state = "fake-" + os.urandom(6).hex(), "running"

    def close(self):
        self.state = "closed"


def test_sandbox_cap_holds_under_concurrent_creates():
    app = create_control_plane(SlowBackend(), token="t0ken", max_sandboxes=8)
    with local_server(app) as url:
        for _ in range(5):  # some exist already
            assert post(url, "/sandboxes", json={}).status_code == 201
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(post(url, "/sandboxes", json={}).status_code))
                   for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [201] * 3 + [429] * 9, codes
        assert len(AgentEnvClient(url, "t0ken").list()) == 8
        app.state.close_all()


def test_request_bodies_are_bounded():
    app = create_control_plane(SlowBackend(), token="t0ken", max_body_bytes=1 << 20)
    with local_server(app) as url:
        big = {"path": "x", "data": "A" * (2 << 20)}
        assert post(url, "/sandboxes/none/files", json=big).status_code == 413  # declared length
        chunks = (b"A" * 65536 for _ in range(64))  # streamed, no length given
        r = post(url, "/sandboxes/none/files", content=chunks, headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert post(url, "/sandboxes/none/files", json={"path": "x", "data": ""}).status_code == 404  # small: on


def serve_proc(args, env, port):
    return subprocess.Popen([sys.executable, "-m", "k3.cli", "agentenv", "serve", "--port", str(port), *args],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("source", ["env", "file"])
def test_serve_token_never_on_the_command_line(plane, tmp_path, source):
    need_backend(plane)
    token, port = "sekrit-" + os.urandom(8).hex(), free_port()
    if source == "env":
        p = serve_proc([], {"K3_AGENTENV_TOKEN": token}, port)
    else:
        (tmp_path / "tok").write_text(token + "\n")
        os.chmod(tmp_path / "tok", 0o600)
        p = serve_proc(["--token-file", str(tmp_path / "tok")], {}, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/sandboxes", headers={"Authorization": f"Bearer {token}"})
                break
            except httpx.TransportError:
                assert p.poll() is None and time.monotonic() < deadline, p.stderr.read().decode()
                time.sleep(0.2)
        assert r.status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/sandboxes").status_code == 401
        cmdlines = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read())
                except OSError:
                    pass
        assert any(b"agentenv\0serve" in c for c in cmdlines)  # the server is there...
        assert not any(token.encode() in c for c in cmdlines)  # ...and its token is in nobody's argv
        p.terminate()
        out, _ = p.communicate(timeout=30)
        assert token.encode() not in out  # a given token is not echoed either
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_refuses_a_token_in_argv():
    p = subprocess.run([sys.executable, "-m", "k3.cli", "agentenv", "serve", "--token", "abc"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "K3_AGENTENV_TOKEN" in p.stderr and "ps" in p.stderr, p.stderr
