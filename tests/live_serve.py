"""A real `k3 serve` process of a small random model, for the tests that drive it with outside tools (lm-eval,
schemathesis): the CLI as a user starts it, on a free loopback port, with an API key."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import Tokenizer
from k3.serve.local_server import serve_process, wait_until_healthy  # noqa: F401  (wait_until_healthy: the tests')


def save_tiny_model(directory: Path, seed: int = 3) -> K3ForCausalLM:
    """A random `tiny` K3 saved in float32 (bit-exact on reload) with the bundled tokenizer; returns the model."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=seed)
    model.save_pretrained(directory, dtype=None)
    Tokenizer.from_file().save_pretrained(directory)
    return model.eval()


@contextmanager
def k3_serve(model_dir: Path, api_key: str, name: str, log_path: Path, *extra: str, timeout: float = 180.0):
    """Start `k3 serve` (one torch thread: the test machine's CPU is shared) and yield its base URL once /health
    answers; the process is stopped when the block ends. A failed start raises with the server's last output."""
    with serve_process(model_dir, log_path, "--api-key", api_key, "--served-model-name", name, "--memory-gib", "0.25",
                       "--block-size", "64", "--match-unit", "16", *extra, timeout=timeout,
                       env={"K3_CPU_THREADS": "1"}) as url:
        yield url
