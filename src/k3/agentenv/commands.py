"""`k3 agentenv serve` (the control plane on loopback; its token from $K3_AGENTENV_TOKEN or --token-file,
never argv, where `ps` shows it) and `k3 agentenv run -- CMD` (one command in a fresh sandbox, its exit status
passed through)."""
from __future__ import annotations

import argparse
import os
import sys

TOKEN_ENV = "K3_AGENTENV_TOKEN"


def _template(s: str) -> tuple[str, str]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"--template must be NAME=DIR, got {s!r}")
    name, d = s.split("=", 1)
    return name, d


def read_token(token_file: str | None) -> str | None:
    """The bearer token from --token-file (first line) or $K3_AGENTENV_TOKEN; None: generate one."""
    if token_file:
        with open(token_file) as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"--token-file {token_file}: the first line is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def cmd_serve(a) -> int:
    if a.token is not None:
        raise ValueError(f"--token would show the secret to every local user in ps; set ${TOKEN_ENV} or pass "
                         "--token-file PATH")
    from k3.agentenv import get_backend
    from k3.agentenv.control_plane import serve
    from k3.cli import check_listen_address
    get_backend(a.backend).require()  # a missing runsc / firecracker: one line, before anything starts
    check_listen_address(a.host, a.port)
    serve(a.backend, a.host, a.port, dict(a.template or []), read_token(a.token_file))
    return 0


def cmd_run(a) -> int:
    from k3.agentenv import Limits, SandboxSpec, get_backend
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        raise ValueError("give a command after --, e.g. k3 agentenv run -- ls /")
    backend = get_backend(a.backend)
    backend.require()
    spec = SandboxSpec(template=a.workspace, limits=Limits(memory_bytes=a.memory_mb << 20, exec_timeout=a.timeout))
    with backend.create(spec) as sb:
        r = sb.exec(cmd, timeout=a.timeout)
    sys.stdout.buffer.write(r.stdout)
    sys.stderr.buffer.write(r.stderr)
    if r.timed_out:
        print(f"k3 agentenv: timed out after {a.timeout}s", file=sys.stderr)
        return 124
    return r.exit_code if r.exit_code is not None else 128 + (r.signal or 9)


def add_agentenv_parser(sub) -> None:
    from k3.cli import tcp_port
    ae = sub.add_parser("agentenv", help="isolated sandboxes for agent rollouts (control plane, one-off runs)")
    asub = ae.add_subparsers(dest="agentenv", required=True)
    s = asub.add_parser("serve", help="E2B-shaped control plane on loopback with a bearer token")
    s.add_argument("--backend", default="bwrap", choices=["bwrap", "gvisor", "firecracker"])
    s.add_argument("--host", default="127.0.0.1", help="loopback only")
    s.add_argument("--port", type=tcp_port, default=49982)
    s.add_argument("--token-file", default=None,
                   help=f"file whose first line is the bearer token (or set ${TOKEN_ENV}; default: generated "
                        "and printed)")
    s.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: argv is public
    s.add_argument("--template", action="append", type=_template, metavar="NAME=DIR")
    s.set_defaults(func=cmd_serve)
    r = asub.add_parser("run", help="run one command in a fresh sandbox: k3 agentenv run -- CMD ...")
    r.add_argument("--backend", default="bwrap", choices=["bwrap", "gvisor", "firecracker"])
    r.add_argument("--workspace", default=None, help="a directory copied in as /workspace's template")
    r.add_argument("--timeout", type=float, default=60.0)
    r.add_argument("--memory-mb", type=int, default=512)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    r.set_defaults(func=cmd_run)
