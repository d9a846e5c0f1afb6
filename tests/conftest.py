"""Shared test settings."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tensors in most tests are tiny, so intra-op threads buy nothing; on a shared 2-core machine
    OpenMP's spin-waiting under contention turned a 0.3 s test into 30 s. Restored after each module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vlm():
    """The small vision-language model of the vision tests (tests/tiny_vlm.py)."""
    from tiny_vlm import make_tiny_vlm
    return make_tiny_vlm()
