"""k3's inference custom ops (k3.ops.triton_dispatch.inference_op / call_op): outside torch.compile the entry points
call the op's function directly, with no dispatcher round trip (issue 21: 28-45 µs a call on the H200's host);
inside torch.compile the graph keeps the op as one call; the dispatcher is kept where a dispatch mode or a gradient
needs it. "Went through the dispatcher" is read from the profiler, which records every dispatched op. On a CPU the
kernels run under Triton's interpreter; skipped where triton is not installed."""
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import

from k3.ops import triton_dispatch  # noqa: E402
from k3.ops.triton_dispatch import call_op, inference_op  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODULES = ("_attn_res_norm_triton", "_attn_res_route_triton", "_gemv_triton", "_kda_decode_triton",
                  "_router_triton", "_mla_static_decode_triton", "_moe_decode_triton", "_moe_expert_major_triton")

_runs = []  # one entry per run of the test op's function: whether its input was a FakeTensor


@inference_op("dispatch_test_axpy", mutates_args=("acc",))
def _axpy(x: torch.Tensor, acc: torch.Tensor, scale: float) -> torch.Tensor:
    """A stand-in kernel: acc += x in place, returns scale · x + 1."""
    _runs.append(isinstance(x, torch._subclasses.FakeTensor))
    acc.add_(x)
    return x * scale + 1


@_axpy.register_fake
def _(x, acc, scale):
    return torch.empty_like(x)


def dispatched(fn, *args):
    """(fn(*args), the names of the k3:: ops the dispatcher ran meanwhile)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, {e.name for e in prof.events() if e.name.startswith("k3::")}


def test_eager_call_runs_the_function_without_the_dispatcher():
    x, acc = torch.arange(4.0), torch.ones(4)
    _runs.clear()
    out, ops = dispatched(call_op, "dispatch_test_axpy", x, acc, 3.0)
    assert ops == set() and _runs == [False]
    assert torch.equal(out, x * 3 + 1) and torch.equal(acc, x + 1)
    _, ops = dispatched(torch.ops.k3.dispatch_test_axpy, x, acc, 3.0)  # (the profiler does see a dispatched op)
    assert ops == {"k3::dispatch_test_axpy"}


def test_compiled_call_keeps_the_op_in_the_graph():
    """fullgraph (no break): the graph holds the op, whose in-place write reaches the caller's tensor, and the
    result equals the eager call's."""
    from compile_recording import recording_backend

    targets = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, acc: call_op("dispatch_test_axpy", x, acc, 2.0) * 2, fullgraph=True,
                             backend=recording_backend(targets))
    x = torch.randn(5)
    acc, acc_eager = torch.zeros(5), torch.zeros(5)
    got = compiled(x, acc)
    assert "k3.dispatch_test_axpy" in targets, targets
    assert torch.equal(got, call_op("dispatch_test_axpy", x, acc_eager, 2.0) * 2) and torch.equal(acc, acc_eager)


@pytest.mark.parametrize("through_call_op", [True, False])
def test_inductor_lowers_the_op_with_the_lowering_call_op_registers(monkeypatch, through_call_op):
    """Inside torch.compile, `call_op` hands inductor the op's lowering as Dynamo traces (a call of the op as it
    is, under its tags' layout constraint), so inductor never builds that fallback itself, which on torch 2.11
    formats every input's IR tree into a log line eagerly (minutes an op in a compiled decode step). The op called
    past `call_op` takes inductor's own path: its log line shows. Both compile to the eager result, the in-place
    write too."""
    import torch._inductor.graph as inductor_graph
    import torch._inductor.lowering as lowering

    op = torch.ops.k3.dispatch_test_axpy.default
    monkeypatch.delitem(lowering.lowerings, op, raising=False)  # (a lowering from an earlier test's compile)
    logged = []
    monkeypatch.setattr(inductor_graph.log, "info", lambda msg, *a, **k: logged.append(msg))
    call = (lambda *a: call_op("dispatch_test_axpy", *a)) if through_call_op else torch.ops.k3.dispatch_test_axpy

    def step(x, acc):
        for _ in range(6):  # a chain of pointwise ops: the op's input is an unrealised IR tree
            x = torch.sin(x) * 1.5 + x
        return call(x, acc, 2.0) - 1

    torch._dynamo.reset()
    x = torch.randn(5, 3)
    acc, acc_eager = torch.zeros(5, 3), torch.zeros(5, 3)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(step, backend="inductor", fullgraph=True)(x, acc)  # lowered again, not loaded
    want = step(x, acc_eager)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(acc, acc_eager)
    implicit = [m for m in logged if "implicit fallback" in str(m)]
    assert (implicit == []) == through_call_op and op in lowering.lowerings


def test_an_input_needing_a_gradient_goes_through_the_op():
    """The op has no autograd formula: through the dispatcher, backward says so, where the bare function would hand
    back an output silently cut from the graph. Under no_grad the same inputs take the function."""
    x = torch.randn(3, requires_grad=True)
    out, ops = dispatched(call_op, "dispatch_test_axpy", x, torch.zeros(3), 1.0)
    assert ops == {"k3::dispatch_test_axpy"} and out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        _, ops = dispatched(call_op, "dispatch_test_axpy", x, torch.zeros(3), 1.0)
    assert ops == set()


def test_a_dispatch_mode_goes_through_the_op():
    """Under FakeTensorMode (tracing outside Dynamo) the op's fake impl answers: the function never sees a fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _runs.clear()
    with FakeTensorMode():
        out = call_op("dispatch_test_axpy", torch.empty(6), torch.empty(6), 1.0)
    assert out.shape == (6,) and _runs == []


def test_every_kernel_module_custom_op_is_an_inference_op():
    """Each custom op the inference kernel modules register is declared through inference_op (so call_op can take
    its function); a plain torch.library.custom_op there would leave its entry point on the dispatcher."""
    pytest.importorskip("triton")
    from torch._library.custom_ops import CustomOpDef

    ops = {}
    for name in KERNEL_MODULES:
        module = triton_dispatch.triton_module(name)
        ops.update({v._name: v for v in vars(module).values() if isinstance(v, CustomOpDef)})
    assert set(ops) == {"attn_res_mix_norm", "attn_res_mix_norm_route", "decode_gemv", "decode_gemv_pair",
                        "kda_decode_step", "route_tokens_decode", "mla_static_decode", "moe_selected_experts",
                        "moe_expert_major"}
    for name, op in ops.items():
        assert triton_dispatch._op_functions.get(name) is op._init_fn, name


def _mix_norm_case(add: bool):
    g = torch.Generator().manual_seed(3)
    D = 96
    sources = tuple(torch.randn(2, 3, D, generator=g) for _ in range(3))
    u, w, nw = torch.rand(D, generator=g) + 0.5, torch.randn(1, D, generator=g), torch.rand(D, generator=g) + 0.5
    extra = torch.randn(2, 3, D, generator=g) if add else None
    return [t.to(DEVICE) if t is not None else None for t in (u, w, *sources, nw, extra)]


@pytest.mark.parametrize("add", [False, True])
def test_mix_norm_eager_entry_skips_the_op(monkeypatch, add):
    """mix_norm_forward (the public entry) with torch.ops.k3.attn_res_mix_norm made to raise: still the
    reference's values, and no k3:: op dispatched."""
    pytest.importorskip("triton")
    from test_attn_res_norm_triton import reference

    kernels = triton_dispatch.triton_module("_attn_res_norm_triton")
    u, w, s0, s1, s2, nw, extra = _mix_norm_case(add)
    monkeypatch.setattr(torch.ops.k3, "attn_res_mix_norm",
                        lambda *a: pytest.fail("the eager entry went through torch.ops.k3.attn_res_mix_norm"))
    with torch.inference_mode():
        (y, total), ops = dispatched(kernels.mix_norm_forward, u, w, 1e-6, (s0, s1, s2), nw, 1e-5, extra)
    assert ops == set()
    want_y, want_total = reference((s0, s1, s2), extra, u, w, 1e-6, nw, 1e-5)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    if add:
        torch.testing.assert_close(total, want_total)
    else:
        assert total is None


def test_mix_norm_compiled_keeps_the_op():
    """Under torch.compile (fullgraph) the same entry is the one op k3::attn_res_mix_norm, equal to eager."""
    pytest.importorskip("triton")
    from compile_recording import recording_backend

    kernels = triton_dispatch.triton_module("_attn_res_norm_triton")
    u, w, s0, s1, s2, nw, extra = _mix_norm_case(True)
    targets = []
    torch._dynamo.reset()
    compiled = torch.compile(kernels.mix_norm_forward, fullgraph=True, backend=recording_backend(targets))
    with torch.inference_mode():
        y, total = compiled(u, w, 1e-6, (s0, s1, s2), nw, 1e-5, extra)
        want_y, want_total = kernels.mix_norm_forward(u, w, 1e-6, (s0, s1, s2), nw, 1e-5, extra)
    assert [t for t in targets if "k3." in t] == ["k3.attn_res_mix_norm"], targets
    assert torch.equal(y, want_y) and torch.equal(total, want_total)


def test_eager_decode_step_with_every_decode_kernel_dispatches_no_k3_op(monkeypatch):
    """The tiny model's decode over a StaticCache with all decode kernels forced on (the compiled twin is
    tests/test_decode_compile_graph.py): each op's function runs, no k3:: op goes through the dispatcher, and the
    logits equal the full forward's."""
    pytest.importorskip("triton")
    import k3.model.attn_res as attn_res
    import k3.ops.gemv as gemv
    import k3.ops.mla_static_decode as mla_static_decode
    import k3.ops.router as router
    from test_decode_compile_graph import STEPS, T, reseed, static_decode

    from k3 import envs
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.ops import kda_decode, moe_decode

    for name in KERNEL_MODULES:
        triton_dispatch.triton_module(name)  # imported now, so that their ops are registered before wrapped below
    if DEVICE == "cpu":
        real = triton_dispatch.use_triton_op
        kernels = ("_router_triton", "_attn_res_norm_triton", "_attn_res_route_triton", "_mla_static_decode_triton",
                   "_gemv_triton")
        forced = lambda x, name: name in kernels if x.device.type == "cpu" else real(x, name)  # noqa: E731
        for module in (attn_res, router, mla_static_decode, gemv):
            monkeypatch.setattr(module, "use_triton_op", forced)
    runs = []
    for name, fn in list(triton_dispatch._op_functions.items()):
        monkeypatch.setitem(triton_dispatch._op_functions, name,
                            lambda *a, _n=name, _f=fn, **k: runs.append(_n) or _f(*a, **k))
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    reseed(model, 4)
    model.to(DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (1, T + STEPS), generator=torch.Generator().manual_seed(4))
    ids = ids.to(DEVICE)
    with (torch.no_grad(), envs.override(triton_opt_in="all"), kda_decode.force_fused_decode(True),
          moe_decode.force_expert_major(True)):
        full = model(ids).logits[:, T:].transpose(0, 1)
        runs.clear()
        eager, ops = dispatched(static_decode, model, model.model, ids)
    assert ops == set(), ops
    # the MoE layers' mix and router are one launch (route_tokens_decode runs where that launch is off:
    # tests/test_attn_res_norm_triton.py)
    assert {"kda_decode_step", "attn_res_mix_norm_route", "attn_res_mix_norm", "mla_static_decode",
            "decode_gemv"} <= set(runs), sorted(set(runs))
    torch.testing.assert_close(eager, full, rtol=2e-4, atol=2e-4)
