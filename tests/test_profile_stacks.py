"""The benchmarks' profiler settings for Python stacks (benchmarks/gpu_bench_util.with_stacks, used by
profile_gpu.py --stack and profile_serve.py): the grouped table names the source lines that launched each op (with
`with_stack=True` alone torch 2.11–2.13 records no stack: pytorch/pytorch#100253)."""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_bench_util import with_stacks  # noqa: E402


def _stack_table(**kwargs) -> str:
    layer = torch.nn.Linear(16, 16)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
        layer(torch.randn(4, 16))
    return prof.key_averages(group_by_stack_n=3).table(sort_by="self_cpu_time_total", row_limit=5,
                                                       max_src_column_width=200)


def test_the_stack_settings_name_the_launching_lines():
    assert "test_profile_stacks.py" in _stack_table(**with_stacks())
