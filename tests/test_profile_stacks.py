"""The benchmarks' profiler settings for Python stacks (benchmarks/gpu_bench_util.with_stacks, used by
profile_gpu.py --stack and profile_serve.py): the grouped table names the source lines that launched each op. (The
benchmarks' tables had none with `with_stack=True` alone, pytorch/pytorch#100253; on torch 2.13's CPU build a
small profile like this one names them either way, session 36, so the test checks the settings, not the bug.)"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_bench_util import ops_matching, ops_table, with_stacks  # noqa: E402


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
    table = ops_table(kept, reps=1, rows=10)
    assert "aten::add" in table and "aten::cat" in table and "aten::randn" not in table


def test_the_ops_table_orders_by_gpu_time_a_step_without_kernel_events():
    """On a GPU the matched rows are CPU ops that carry their kernels' time (torch's own table asserts on such a list:
    its GPU total counts kernel events only, and there are none in it): ops_table prints them most GPU time first,
    in ms and calls a step over the profiled steps, with their shapes or stack, and the rows' total."""
    from types import SimpleNamespace

    row = lambda key, us, n, shapes=None, stack=None: SimpleNamespace(  # noqa: E731
        key=key, self_device_time_total=us, count=n, input_shapes=shapes, stack=stack)
    rows = ops_matching([row("aten::copy_", 3000.0, 40, [[8, 4096]]), row("aten::mm", 9e5, 2),
                         row("aten::add_", 9000.0, 6, stack=["moe.py(10): f", "x.py(2): g"])], r"^aten::(copy_|add_)$")
    lines = ops_table(rows, reps=2, rows=10).splitlines()
    assert lines[1] == "4.500 | 3 | aten::add_ | moe.py(10): f <- x.py(2): g"
    assert lines[2] == "1.500 | 20 | aten::copy_ | [[8, 4096]]"
    assert lines[3] == "total 6.000 ms a step over 2 rows"
