"""The host side of the guest-agent channel, shared by the backends: requests carry a fresh nonce the agent
echoes (an answer without it is stale or forged and is dropped); answer lines are read with a size cap and
no quadratic re-scanning; every answer is checked field by field; every failure is a `SandboxError`.
`run_capped` runs a one-shot command (gVisor's `runsc exec`) with the same caps on what it may print."""
from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import selectors
import subprocess
import time

from k3.agentenv.api import SandboxError, SandboxTimeout

MAX_TAR_BYTES = 256 << 20  # the guest agent refuses larger tar downloads
ANSWER_OVERHEAD = 1 << 20  # room for the JSON around the base64 payloads of an answer

# the fields of each answer and their types (base64 payloads are checked when decoded)
ANSWER_FIELDS = {
    "exec": {"stdout": str, "stderr": str, "exit_code": (int, type(None)), "signal": (int, type(None)),
             "timed_out": bool, "truncated": bool, "duration": (int, float)},
    "spawn": {"handle": str},
    "poll": {"stdout": str, "stderr": str, "running": bool, "exit_code": (int, type(None)),
             "signal": (int, type(None))},
    "read": {"data": str},
    "tar_get": {"data": str},
    "list": {"entries": list},
}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def max_answer_bytes(payload_bytes: int) -> int:
    """The longest answer line that can carry `payload_bytes` of raw data (base64 grows it by 4/3)."""
    return 4 * ((payload_bytes + 2) // 3) + ANSWER_OVERHEAD


def new_request(op: str, **fields) -> tuple[bytes, str]:
    """One request line and its nonce."""
    nonce = secrets.token_hex(16)
    return (json.dumps({"op": op, "nonce": nonce, **fields}) + "\n").encode(), nonce


def parse_answer(line: bytes, op: str, nonce: str) -> dict | None:
    """The checked answer to the request with `nonce`, None for an answer to another (earlier) request;
    raises SandboxError for a malformed answer or one that reports a failure."""
    try:
        res = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise SandboxError(f"guest agent sent a malformed answer to {op} ({len(line)} bytes)") from None
    if not isinstance(res, dict):
        raise SandboxError(f"guest agent sent a non-object answer to {op}")
    if not secrets.compare_digest(str(res.get("nonce", "")), nonce):
        return None
    if res.get("ok") is not True:
        raise SandboxError(f"{op} failed in sandbox: {str(res.get('error'))[:2000]}")
    for name, types in ANSWER_FIELDS.get(op, {}).items():
        if not _has_type(res.get(name), types):
            raise SandboxError(f"guest agent's answer to {op}: field {name!r} is {type(res.get(name)).__name__}")
    return res


def _has_type(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):  # bool is an int subclass: only where bool itself is expected
        return bool in types
    return isinstance(value, types)


def b64field(res: dict, name: str) -> bytes:
    try:
        return base64.b64decode(res[name], validate=True)
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise SandboxError(f"guest agent's answer: field {name!r} is not valid base64") from None


class LineReader:
    """Answer lines from a pipe: at most `max_line` bytes each, a line found by scanning only new bytes."""

    def __init__(self, fd: int, max_line: int, describe_exit=lambda: ""):
        self.fd, self.max_line, self.describe_exit = fd, max_line, describe_exit
        self.buf = bytearray()
        self.scanned = 0  # bytes of buf known to hold no newline

    def read_line(self, deadline: float, stop=lambda: None) -> bytes:
        """The next line (without its newline). `stop()` may raise to abandon the wait (e.g. a paused box)."""
        while True:
            i = self.buf.find(b"\n", self.scanned)
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[:i + 1]
                self.scanned = 0
                return line
            self.scanned = len(self.buf)
            if len(self.buf) > self.max_line:
                raise SandboxError(f"guest agent's answer is longer than {self.max_line} bytes; channel closed")
            stop()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxTimeout("guest agent did not answer in time")
            sel = selectors.DefaultSelector()
            try:
                sel.register(self.fd, selectors.EVENT_READ)
                ready = sel.select(min(left, 0.5))
            finally:
                sel.close()
            if ready:
                try:
                    chunk = os.read(self.fd, min(1 << 20, self.max_line + 1 - len(self.buf)))
                except BlockingIOError:
                    continue
                except OSError as e:
                    raise SandboxError(f"guest agent channel failed: {e}") from None
                if not chunk:
                    raise SandboxError(f"guest agent exited{self.describe_exit()}")
                self.buf += chunk


def run_capped(argv: list[str], stdin: bytes, timeout: float, max_stdout: int, max_stderr: int = 64 << 10,
               env: dict | None = None) -> tuple[int | None, bytes, bytes]:
    """Run `argv` feeding it `stdin`; (returncode, stdout, stderr). A process that prints past its caps or
    runs past `timeout` is killed and SandboxError raised: the host never holds more than the caps."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            close_fds=True, env=env)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    caps = {out_fd: max_stdout, err_fd: max_stderr}
    bufs = {fd: bytearray() for fd in caps}
    sel = selectors.DefaultSelector()
    pending, in_fd = memoryview(stdin), proc.stdin.fileno()
    os.set_blocking(in_fd, False)
    sel.register(in_fd, selectors.EVENT_WRITE)
    for fd in caps:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    problem = ""
    try:
        while sel.get_map() and not problem:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"timed out after {timeout:.0f}s"
                break
            for key, _ in sel.select(min(left, 0.5)):
                if key.fd == in_fd:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not len(pending):
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
                if len(bufs[key.fd]) > caps[key.fd]:
                    problem = f"printed more than {caps[key.fd]} bytes"
                    break
    finally:
        sel.close()
        if problem:
            proc.kill()
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    if problem:
        raise SandboxError(f"{os.path.basename(argv[0])} {problem}; killed")
    return rc, bytes(bufs[out_fd]), bytes(bufs[err_fd])
