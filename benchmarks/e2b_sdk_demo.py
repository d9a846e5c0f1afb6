"""Drive `k3 agentenv serve` with the official E2B SDK, end to end, and time each call.

Starts `k3 agentenv serve` (bwrap) as its own process on a free loopback port, points the unmodified `e2b`
SDK at it through its documented environment variables only, and walks a sandbox through create, list,
get_info, set_timeout, commands (blocking, streamed, background + wait, kill), files, pause, connect (resume),
is_running and kill. Prints one line per step with its wall time (ms).

    python benchmarks/e2b_sdk_demo.py
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

from k3.serve.local_server import free_port


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"k3 agentenv serve exited with {proc.returncode}")
        try:
            httpx.get(url + "/v2/sandboxes", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("k3 agentenv serve did not start")


def main() -> int:
    token, port = secrets.token_urlsafe(16), free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "k3.cli", "agentenv", "serve", "--port", str(port)],
                              env={**os.environ, "K3_AGENTENV_TOKEN": token})
    try:
        wait_up(url, server)
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=token)
        from importlib.metadata import version

        from e2b import CommandExitException, Sandbox

        print(f"e2b {version('e2b')} (unmodified) against {url}, configured by E2B_API_URL, E2B_SANDBOX_URL, "
              "E2B_API_KEY only")

        def step(name, fn):
            t0 = time.perf_counter()
            out = fn()
            shown = getattr(out, "sandbox_id", None) or (f"pid {out.pid}" if hasattr(out, "pid") else out)
            print(f"{name:<38} {1000 * (time.perf_counter() - t0):8.1f} ms  {shown}")
            return out

        sb = step("Sandbox.create", lambda: Sandbox.create(timeout=120, metadata={"demo": "e2b"}))
        sid = sb.sandbox_id
        step("Sandbox.list", lambda: [s.sandbox_id == sid for s in Sandbox.list().next_items()])
        step("get_info", lambda: (sb.get_info().state.value, sb.get_info().memory_mb))
        step("set_timeout(300)", lambda: sb.set_timeout(300))
        step("commands.run (blocking)", lambda: sb.commands.run("echo hello; uname -s").stdout.split())
        lines: list[str] = []
        step("commands.run (on_stdout callback)",
             lambda: (sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done",
                                      on_stdout=lines.append).exit_code, lines))
        step("commands.run exit 3",
             lambda: _exit_code(lambda: sb.commands.run("exit 3"), CommandExitException))
        bg = step("commands.run (background)", lambda: sb.commands.run("sleep 0.2; echo bg", background=True))
        step("  commands.list", lambda: [p.pid for p in sb.commands.list()] == [bg.pid])
        step("  handle.wait", lambda: bg.wait().stdout.strip())
        long = sb.commands.run("sleep 60", background=True)
        step("commands.kill", lambda: sb.commands.kill(long.pid))
        step("  killed handle.wait", lambda: _exit_code(long.wait, CommandExitException))
        step("files.write", lambda: sb.files.write("/workspace/notes/a.txt", "hello e2b").path)
        step("files.read", lambda: sb.files.read("/workspace/notes/a.txt"))
        step("files.make_dir", lambda: sb.files.make_dir("/workspace/out"))
        step("files.list", lambda: sorted(e.name for e in sb.files.list("/workspace")))
        step("files.exists", lambda: (sb.files.exists("/workspace/notes/a.txt"), sb.files.exists("/nope")))
        step("files.remove", lambda: (sb.files.remove("/workspace/notes"), sb.files.exists("/workspace/notes"))[1])
        step("pause", lambda: sb.pause())
        step("  is_running (paused)", lambda: sb.is_running())
        sb2 = step("Sandbox.connect (resume)", lambda: Sandbox.connect(sid))
        step("  first command after resume", lambda: sb2.commands.run("echo back").stdout.strip())
        step("  is_running", lambda: sb2.is_running())
        step("kill", lambda: sb2.kill())
        step("  is_running (killed)", lambda: sb2.is_running())

        from e2b_code_interpreter import Sandbox as CodeSandbox
        ci = step("code_interpreter Sandbox.create", lambda: CodeSandbox.create(timeout=60))
        step("  run_code (state, stdout)", lambda: _cell(ci.run_code("x = 6 * 7\nprint('hi')\nx")))
        step("  run_code (state kept)", lambda: _cell(ci.run_code("x + 1")))
        step("  run_code (error)", lambda: ci.run_code("1 / 0").error.name)
        step("  kill", lambda: ci.kill())
        return 0
    finally:
        server.terminate()
        server.wait(30)


def _cell(ex):
    return [r.text for r in ex.results], ex.logs.stdout


def _exit_code(fn, exc):
    try:
        return fn().exit_code
    except exc as e:
        return f"{type(e).__name__} exit_code={e.exit_code} error={e.error!r}"


if __name__ == "__main__":
    sys.exit(main())
