"""`serve_process`'s start: a port lost to another binder is retried on a new one (up to 3 starts), any other
failure, or an interrupt while waiting for /health, stops the server it started before the error goes on. The
server is a stand-in process object here (the real `k3 serve` starts are the serving tests')."""
import pytest

from k3.serve import local_server


class FakeProcess:
    started: list["FakeProcess"] = []

    def __init__(self, cmd, **_):
        self.port = int(cmd[cmd.index("--port") + 1])
        self.stopped = False
        FakeProcess.started.append(self)

    def poll(self):
        return 1 if self.stopped else None

    def terminate(self):
        self.stopped = True

    def wait(self, timeout=None):
        return 1


@pytest.fixture
def fake_starts(monkeypatch, tmp_path):
    """(the starts made, a function setting what each wait for /health does: an exception to raise, or None)"""
    FakeProcess.started = []
    outcomes = []
    ports = iter(range(40001, 40010))
    monkeypatch.setattr(local_server.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(local_server, "free_port", lambda: next(ports))

    def wait(url, alive, timeout, last_output):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
    monkeypatch.setattr(local_server, "wait_until_healthy", wait)
    return FakeProcess.started, outcomes.extend, tmp_path / "log"


def test_a_port_taken_before_the_server_bound_it_is_retried_on_a_new_port(fake_starts):
    started, outcomes, log = fake_starts
    taken = RuntimeError("k3 serve did not start: ... [Errno 98] address already in use")
    outcomes([taken, taken, None])
    with local_server.serve_process("model", log) as url:
        assert url == "http://127.0.0.1:40003" and [p.stopped for p in started] == [True, True, False]
    assert len(started) == 3 and all(p.stopped for p in started)


def test_the_third_lost_port_or_another_failure_raises_with_the_server_stopped(fake_starts):
    started, outcomes, log = fake_starts
    taken = RuntimeError("address already in use")
    outcomes([taken, taken, taken])
    with pytest.raises(RuntimeError, match="address already in use"), local_server.serve_process("model", log):
        pass
    outcomes([RuntimeError("k3 serve did not start: no such model")])
    with pytest.raises(RuntimeError, match="no such model"), local_server.serve_process("model", log):
        pass
    assert len(started) == 4 and all(p.stopped for p in started)


def test_an_interrupt_while_waiting_for_health_stops_the_server(fake_starts):
    started, outcomes, log = fake_starts
    outcomes([KeyboardInterrupt()])
    with pytest.raises(KeyboardInterrupt), local_server.serve_process("model", log):
        pass
    assert len(started) == 1 and started[0].stopped
