"""torch.compiler's `assume_constant_result` and `disable`, without importing Dynamo when the module loads.

Both public decorators import torch._dynamo (about half the time of importing the model) as they are applied, at
import; programs that never compile (the CLI, the CPU tests, serving without graphs) should not pay for it.
`assume_constant_result` only sets a mark that Dynamo reads when it traces a call: we set the same mark
(tests/test_import_cost.py checks that the public decorator leaves exactly it, and a change in torch also shows as
graph breaks in tests/test_decode_compile_graph.py). `compile_disabled` applies `torch.compiler.disable` at the
first call, by which time a compiling program has Dynamo loaded anyway.
"""
import functools

import torch

MARK = "_dynamo_marked_constant"


def assume_constant_result(fn):
    """Mark fn so that torch.compile runs it as it traces and takes its answer as a constant (no graph break);
    returns fn itself, as the public decorator does."""
    setattr(fn, MARK, True)
    return fn


def compile_disabled(fn):
    """`torch.compiler.disable(fn)`, made at the first call: torch.compile breaks its graph there and fn runs
    eagerly, never traced."""
    disabled = []  # (a list, not a rebound name: a compiled caller then sees one object and does not recompile)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call
