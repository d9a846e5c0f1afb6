"""A real `k3 serve` process of a small random model, for the tests that drive it with outside tools (lm-eval,
schemathesis): the CLI as a user starts it, on a free loopback port, with an API key."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import Tokenizer


def save_tiny_model(directory: Path, seed: int = 3) -> K3ForCausalLM:
    """A random `tiny` K3 saved in float32 (bit-exact on reload) with the bundled tokenizer; returns the model."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=seed)
    model.save_pretrained(directory, dtype=None)
    Tokenizer.from_file().save_pretrained(directory)
    return model.eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, alive, timeout: float, last_output) -> None:
    """Poll `url`/health until it answers 200; raise RuntimeError with `last_output()` (the servers' logs) when
    `alive()` turns false or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"k3 serve did not start: {last_output()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


@contextmanager
def k3_serve(model_dir: Path, api_key: str, name: str, log_path: Path, *extra: str, timeout: float = 180.0):
    """Start `k3 serve` (one torch thread: the test machine's CPU is shared) and yield its base URL once /health
    answers; the process is stopped when the block ends. A failed start raises with the server's last output."""
    port = _free_port()
    env = {**os.environ, "K3_CPU_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--model", str(model_dir), "--port",
                                 str(port), "--api-key", api_key, "--served-model-name", name, "--memory-gib", "0.25",
                                 "--block-size", "64", "--match-unit", "16", *extra],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, lambda: proc.poll() is None, timeout, lambda: log_path.read_text()[-2000:])
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
