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


@pytest.fixture(scope="session")
def short_corpus(tmp_path_factory) -> str:
    """The bundled documents cut to 1,500 characters each: a Trainer on it tokenises in milliseconds, where the
    whole corpus takes seconds (tens of them on a loaded 2-core machine)."""
    import json
    import lzma

    from k3.data import load_corpus
    path = tmp_path_factory.mktemp("corpus") / "short.jsonl.xz"
    lines = [json.dumps({"title": d.title, "text": d.text[:1500]}) for d in load_corpus()]
    path.write_bytes(lzma.compress("\n".join(lines).encode()))
    return str(path)


@pytest.fixture(scope="module")
def vlm():
    """The small vision-language model of the vision tests (tests/tiny_vlm.py)."""
    from tiny_vlm import make_tiny_vlm
    return make_tiny_vlm()


@pytest.fixture(scope="module", autouse=True)
def no_agentenv_leftovers(request):
    """After each agentenv module: no sandbox directory, mount, layer hold, cgroup or sandbox-uid process left."""
    yield
    if not request.module.__name__.split(".")[-1].startswith("test_agentenv"):
        return
    import time

    from k3.agentenv import hostfs
    deadline = time.monotonic() + 5  # a TTL timer's close may still be finishing
    while hostfs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hostfs.leftovers() == []
