"""The control plane over HTTP on loopback: bearer token required, E2B-shaped lifecycle, exec and files
through the client; with an unavailable backend, create fails with the backend's reason."""
import httpx
import pytest

from k3.agentenv import get_backend
from k3.agentenv.api import Backend
from k3.agentenv.client import AgentEnvClient, ControlPlaneError
from k3.agentenv.control_plane import create_control_plane
from k3.serve.local_server import local_server


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
