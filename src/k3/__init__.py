"""k3: Kimi K3 from scratch in PyTorch."""
from k3 import cpu_threads as _cpu_threads

_cpu_threads.prepare_openmp_env()  # before anything imports torch: libgomp reads its wait policy once, at load

from k3.config import ConfigError, K3Config

__version__ = "0.1.0"


def __getattr__(name):
    # The model pulls in torch; keep `import k3` light for the CLI's argument parsing.
    if name == "K3ForCausalLM":
        from k3.model.decoder import K3ForCausalLM
        return K3ForCausalLM
    raise AttributeError(name)


__all__ = ["K3Config", "ConfigError", "K3ForCausalLM"]
