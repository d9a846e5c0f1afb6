"""The benchmarks' profiler settings for Python stacks (benchmarks/gpu_bench_util.with_stacks, used by
profile_gpu.py --stack and profile_serve.py): the grouped table names the source lines that launched each op. (The
benchmarks' tables had none with `with_stack=True` alone, pytorch/pytorch#100253; on torch 2.13's CPU build a
small profile like this one names them either way, session 36, so the test checks the settings, not the bug.)"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_bench_util import ops_matching, with_stacks  # noqa: E402


def _launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Called here, not through nn.Module: the matmul's second frame is this file's. Through a Module its three
    # frames were torch's (linear.py, module.py twice), and the test passed only while `randn`'s row, launched
    # from this file, ranked among the 5 shown: on a busy machine it did not (session 36).
    return torch.nn.functional.linear(x, w)


def _stack_table(**kwargs) -> str:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
        _launch(torch.randn(4, 16), torch.randn(16, 16))
    return prof.key_averages(group_by_stack_n=3).table(sort_by="self_cpu_time_total", row_limit=20,
                                                       max_src_column_width=200)


def test_the_stack_settings_name_the_launching_lines():
    assert "test_profile_stacks.py" in _stack_table(**with_stacks())


def test_ops_matching_keeps_only_the_named_ops():
    """profile_gpu.py --ops: the grouped tables again with only the ops whose names match."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        x = torch.randn(8, 8)
        torch.cat([x + x, x * 2])
    averages = prof.key_averages(group_by_input_shape=True)
    assert {"aten::randn", "aten::add", "aten::mul", "aten::cat"} <= {e.key for e in averages}
    kept = ops_matching(averages, r"^aten::(add|cat)$")
    assert sorted(e.key for e in kept) == ["aten::add", "aten::cat"]
    table = kept.table(sort_by="self_cpu_time_total", row_limit=10)
    assert "aten::add" in table and "aten::randn" not in table
