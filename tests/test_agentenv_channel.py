"""The host side of the guest-agent channel under a hostile or broken agent (a forger who got hold of the
channel, a crashed agent, a flood): every failure is a SandboxError, nothing is buffered past its cap, stale
and forged answers (without this call's nonce) are dropped."""
import base64
import json
import os
import threading
import time

import pytest

from k3.agentenv import SandboxError, SandboxTimeout
from k3.agentenv import channel


def feed(chunks, close=True):
    """A pipe whose write end a thread fills with `chunks`; returns the read fd."""
    r, w = os.pipe()

    def run():
        try:
            for c in chunks:
                os.write(w, c)
        except BrokenPipeError:
            pass
        finally:
            if close:
                os.close(w)
    threading.Thread(target=run, daemon=True).start()
    return r


def answer(nonce, **fields):
    return (json.dumps({"ok": True, "nonce": nonce, **fields}) + "\n").encode()


def test_newline_free_flood_stops_at_the_cap():
    fd = feed([b"A" * 65536] * 400, close=False)  # 25 MiB without a newline
    reader = channel.LineReader(fd, 1 << 20)
    with pytest.raises(SandboxError, match="longer than"):
        reader.read_line(time.monotonic() + 30)
    assert len(reader.buf) <= (1 << 20) + 1  # never held more than the cap
    os.close(fd)


def test_lines_split_across_many_reads_come_back_whole():
    line = b'{"k": "' + b"x" * 300000 + b'"}\n'
    fd = feed([line[i:i + 1000] for i in range(0, len(line), 1000)] + [b"second\n"])
    reader = channel.LineReader(fd, 1 << 20)
    assert reader.read_line(time.monotonic() + 10) == line[:-1]
    assert reader.read_line(time.monotonic() + 10) == b"second"
    with pytest.raises(SandboxError, match="exited"):
        reader.read_line(time.monotonic() + 10)
    os.close(fd)


def test_silent_agent_times_out_as_sandbox_error():
    r, w = os.pipe()
    with pytest.raises(SandboxTimeout):
        channel.LineReader(r, 1024).read_line(time.monotonic() + 0.3)
    assert issubclass(SandboxTimeout, SandboxError)
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("line", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_malformed_answer_is_a_sandbox_error(line):
    with pytest.raises(SandboxError, match="malformed|non-object"):
        channel.parse_answer(line, "read", "n1")


def test_answers_without_this_calls_nonce_are_dropped():
    forged = answer("guess", data=base64.b64encode(b"FORGED").decode())
    assert channel.parse_answer(forged.strip(), "read", "real-nonce") is None
    assert channel.parse_answer(answer(None, data="").strip(), "read", "real-nonce") is None
    good = channel.parse_answer(answer("real-nonce", data=base64.b64encode(b"ok").decode()).strip(), "read",
                                "real-nonce")
    assert channel.b64field(good, "data") == b"ok"


@pytest.mark.parametrize("fields, bad", [
    ({"stdout": 5, "stderr": "", "exit_code": 0, "signal": None, "timed_out": False, "truncated": False,
      "duration": 0.1}, "stdout"),
    ({"stdout": "", "stderr": "", "exit_code": "0", "signal": None, "timed_out": False, "truncated": False,
      "duration": 0.1}, "exit_code"),
    ({"stdout": "", "stderr": "", "exit_code": True, "signal": None, "timed_out": False, "truncated": False,
      "duration": 0.1}, "exit_code"),
    ({"stdout": "", "stderr": "", "exit_code": 0, "signal": None, "timed_out": "no", "truncated": False,
      "duration": 0.1}, "timed_out"),
    ({"stderr": "", "exit_code": 0, "signal": None, "timed_out": False, "truncated": False, "duration": 0.1},
     "stdout"),
])
def test_answer_fields_are_type_checked(fields, bad):
    with pytest.raises(SandboxError, match=bad):
        channel.parse_answer(answer("n", **fields).strip(), "exec", "n")


def test_invalid_base64_in_an_answer_is_a_sandbox_error():
    res = channel.parse_answer(answer("n", data="!!not base64!!").strip(), "read", "n")
    with pytest.raises(SandboxError, match="base64"):
        channel.b64field(res, "data")


def test_failure_answer_carries_the_agents_message():
    line = json.dumps({"ok": False, "nonce": "n", "error": "ValueError: nope"}).encode()
    with pytest.raises(SandboxError, match="read failed in sandbox: ValueError: nope"):
        channel.parse_answer(line, "read", "n")


def test_run_capped_kills_a_flood_and_keeps_only_the_cap():
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="more than 1048576 bytes"):
        channel.run_capped(["yes", "0123456789"], b"", 30, 1 << 20)
    assert time.monotonic() - t0 < 10


def test_run_capped_timeout_and_normal_run():
    with pytest.raises(SandboxError, match="timed out"):
        channel.run_capped(["sleep", "30"], b"", 0.5, 1024)
    rc, out, err = channel.run_capped(["sh", "-c", "cat; echo e >&2; exit 3"], b"in" * 100000, 30, 1 << 20)
    assert (rc, out, err) == (3, b"in" * 100000, b"e\n")
