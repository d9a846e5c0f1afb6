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


@pytest.fixture
def fresh_fla_caches():
    """k3's per-process answers about the installed fla (whether it imports; whether the lean entries fit its series)
    forgotten before and after the test: a test's stub fla is judged on its own and never stays cached for later
    tests of the process (on a GPU, a cached "no fla" sent a whole xdist worker's later tests to the references)."""
    from k3.ops import kda_fla, kda_fla_lean
    caches = (kda_fla.fla_available, kda_fla_lean.lean_supported)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


@pytest.fixture
def stub_fla(monkeypatch, fresh_fla_caches):
    """install(chunk_kda): fla, fla.ops and fla.ops.kda replaced by stub modules whose kda module has `chunk_kda`."""
    import sys
    import types

    def install(chunk_kda):
        kda = types.ModuleType("fla.ops.kda")
        kda.chunk_kda = chunk_kda
        for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                          ("fla.ops.kda", kda)):
            monkeypatch.setitem(sys.modules, name, mod)
    return install


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
    # a TTL timer's close may still be finishing, and killed sandbox processes take a while to exit on a loaded
    # machine (a clean clone's `make test`, session 27: two outlived 5 s and were gone soon after; CI after session
    # 33: two outlived 20 s); a leak stays. Each leftover process is named with its state, parent and cgroup.
    deadline = time.monotonic() + 60
    while hostfs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hostfs.leftovers() == []


# ---- sharing the machine: `make test` runs the suite as two xdist workers (pytest -n 2 --dist loadgroup) --------
# Tests that time work on the machine, read its load, or assert how fast the host answers cannot run beside another
# worker: they are marked `serial`, left out of the parallel pass (-m "not serial") and run after it, alone.
SERIAL_MODULES = {
    "test_cpu_threads.py": "reads the machine's load (/proc/stat) and times OpenMP workers' CPU",
    "test_serve_hostile.py": "asserts the server's header timeout to within 0.3 s",
}
SERIAL_TESTS = {  # (all cases of a parametrized test)
    **{f"test_agentenv_sandbox.py::{name}": "asserts the host never stalls 1 s while a sandbox is attacked"
       for name in ("test_resource_attacks_fail_inside", "test_gvisor_memory_over_many_processes_ends_whole_sandbox",
                    "test_sleep_past_ttl_is_killed_and_nothing_left")},
    "test_serve_protocol.py::test_health_answers_while_a_million_token_prompt_is_tokenized":
        "asserts /health answers within 1 s while a core tokenises",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: cannot share the machine with another test process (conftest.py)")


def pytest_collection_modifyitems(config, items):
    """Marks the serial tests, and puts each module's tests in one xdist group (module-scoped fixtures are then
    built once, by one worker); the agentenv modules share one group, since each checks after itself that no
    sandbox is left on the machine, which another worker's live sandboxes would fail."""
    for item in items:
        module = item.path.name
        test = f"{module}::{item.name.split('[')[0]}"
        if module in SERIAL_MODULES or test in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
        item.add_marker(pytest.mark.xdist_group("agentenv" if module.startswith("test_agentenv") else module))
