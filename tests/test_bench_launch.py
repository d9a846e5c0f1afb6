"""The benches' launch-shape overrides (benchmarks/gpu_bench_util: `parse_launch` reads `--launch MODULE:k=v`,
`changed_launch` applies it): values typed as the LAUNCH entries are, unknown modules and keys refused, and the
defaults back after the block, also when it raises. The kernel modules need Triton, so a stand-in module with a
LAUNCH dict takes a real one's place under k3.ops."""
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_bench_util import changed_launch, parse_launch  # noqa: E402


@pytest.fixture
def kernel(monkeypatch):
    module = types.ModuleType("k3.ops._stand_in_triton")
    module.LAUNCH = dict(block_l=64, prefetch=False, order="rows")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_launch_change_is_parsed_applied_and_put_back(kernel):
    launch, change = parse_launch("_stand_in_triton:block_l=128,prefetch=true,order=cols")
    assert launch is kernel.LAUNCH and change == {"block_l": 128, "prefetch": True, "order": "cols"}
    with pytest.raises(RuntimeError):
        with changed_launch(launch, change):
            assert kernel.LAUNCH == {"block_l": 128, "prefetch": True, "order": "cols"}
            raise RuntimeError("a launch failed")
    assert kernel.LAUNCH == {"block_l": 64, "prefetch": False, "order": "rows"}


@pytest.mark.parametrize("spec, error", [
    ("_stand_in_triton:block_m=32", "has no 'block_m'"),  # a key the kernel does not read: refused, not ignored
    ("_stand_in_triton", "expected MODULE:k=v"),
    ("_stand_in_triton:", "expected MODULE:k=v"),
    ("gemv:block_l=1", "expected MODULE:k=v"),  # a k3.ops module without LAUNCH
])
def test_a_bad_launch_spec_is_refused(kernel, spec, error):
    with pytest.raises(ValueError, match=error):
        parse_launch(spec)
    assert kernel.LAUNCH["block_l"] == 64


def test_a_module_outside_k3_ops_is_not_imported():
    with pytest.raises(ImportError):
        parse_launch("no_such_kernel_module:block_l=1")
