"""Importing k3 and its model does not import Dynamo (torch._dynamo, ~1.7 s of a 3 s model import before): only
programs that compile pay for it. k3.ops.lazy_dynamo stands in for the torch.compiler decorators that import it."""
import subprocess
import sys

import torch

from k3.ops.lazy_dynamo import assume_constant_result, compile_disabled


def _loads_dynamo(statement: str) -> bool:
    code = f"import sys; {statement}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1] == "True"


def test_torch_alone_does_not_import_dynamo():
    # the premise of the test below: were torch itself to load it, k3 could do nothing about it
    assert not _loads_dynamo("import torch")


def test_importing_k3_and_its_model_does_not_import_dynamo():
    assert not _loads_dynamo("import k3, k3.serve, k3.train; from k3 import K3ForCausalLM")


def test_assume_constant_result_leaves_the_mark_of_the_public_decorator():
    def ours():
        return 1

    def public():
        return 1

    assert assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(public) is public
    assert vars(ours) == vars(public) and vars(ours)  # the same mark, and a mark at all


def test_assume_constant_result_is_run_as_traced_without_graph_break():
    calls = []

    @assume_constant_result
    def host_number(n: int) -> int:
        calls.append(n)  # a side effect Dynamo cannot trace: traced, it would break the graph
        return n * 3

    f = torch.compile(lambda x: x * host_number(7), fullgraph=True, backend="eager")
    x = torch.randn(5)
    torch.testing.assert_close(f(x), x * 21)
    torch.testing.assert_close(f(x + 1), (x + 1) * 21)
    assert calls == [7]  # run once, as the region was traced; its answer then a constant of the graph


def test_compile_disabled_runs_eagerly_behind_a_graph_break():
    seen = []

    @compile_disabled
    def eager_only(x):
        seen.append(torch.compiler.is_compiling())
        return x * (2 if x.sum().item() > 0 else -1)  # a host read: traced, it would break the graph itself

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda x: eager_only(x + 1) - 1, backend=backend)
    for seed in range(3):
        x = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        y = x + 1
        torch.testing.assert_close(f(x), y * (2 if y.sum() > 0 else -1) - 1)
    assert seen == [False] * 3  # never traced
    assert len(graphs) == 2  # the parts before and after the break, compiled once (no recompile per call)
