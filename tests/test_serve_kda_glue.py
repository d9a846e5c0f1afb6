"""KDA's per-call glue in the serving step: the three short convs' weights stacked once per layer (kept up to date
when the weights change: an in-place update, a dtype move, a load), x's three parts joined as a view of the fused
projection's output, and no-op casts skipped before fla's entries."""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import k3.model.kda as kda_model
import k3.serve.runner as runner_mod
from k3 import K3Config, K3ForCausalLM
from k3.ops.fused_linear import FusedLinears, StackedWeights, fuse_projections, joined_columns
from k3.ops.kda_fla_lean import dense_as
from k3.serve import SamplingParams
from test_serve_engine import GREEDY, engine, model, prompt, reference  # noqa: F401


def kda_layers(m):
    return [x for x in m.modules() if isinstance(x, kda_model.KimiDeltaAttention)]


def expected(layer):
    return torch.cat([c.weight.detach() for c in layer.convs])


def test_stacked_conv_weights_follow_updates_moves_and_loads():
    m = K3ForCausalLM(K3Config.preset("tiny"))
    m.reset_parameters(seed=0)
    layer = kda_layers(m)[0]
    stack = layer.conv_weights
    assert stack.weight is None
    with torch.no_grad():  # off: a concatenation per call (training never holds the copy)
        assert torch.equal(stack.current(), expected(layer))
    assert stack.weight is None
    fuse_projections(m)
    with torch.no_grad():
        first = stack.current()
        assert stack.current() is first and torch.equal(first, expected(layer))
        ptr = first.data_ptr()
        layer.k_conv1d.weight.add_(1.0)  # an optimizer-like in-place update: rewritten in place
        assert stack.current().data_ptr() == ptr and torch.equal(stack.current(), expected(layer))
        other = K3ForCausalLM(K3Config.preset("tiny"))
        other.reset_parameters(seed=5)
        m.load_state_dict(other.state_dict())  # a load copies into the same storage
        assert torch.equal(stack.current(), expected(kda_layers(other)[0]))
        m.to(torch.float64)  # a move: rebuilt in the new dtype
        assert stack.current().dtype == torch.float64 and torch.equal(stack.current(), expected(layer))
        layer.v_conv1d.weight.data = layer.v_conv1d.weight.data * 2  # new storage (as the HF loader's casts)
        assert torch.equal(stack.current(), expected(layer))
    w = layer.q_conv1d.weight  # a call that needs a gradient gets a concatenation autograd sees
    assert stack.current().grad_fn is not None and w.requires_grad


def test_joined_columns_is_a_view_of_adjacent_parts_else_a_concatenation():
    lins = [torch.nn.Linear(6, n, bias=False) for n in (3, 4, 5)]
    fused = FusedLinears(*lins)
    fused.refresh()
    x = torch.randn(2, 7, 6)
    with torch.no_grad():
        parts = fused(x)
        joined = joined_columns(parts)
        assert torch.equal(joined, torch.cat(parts, -1))
        assert joined.data_ptr() == parts[0].data_ptr()  # no copy
        swapped = joined_columns([parts[1], parts[0]])  # not in storage order: copied
        assert torch.equal(swapped, torch.cat([parts[1], parts[0]], -1))
        assert swapped.data_ptr() != parts[1].data_ptr()
        gap = joined_columns([parts[0], parts[2]])  # not adjacent
        assert torch.equal(gap, torch.cat([parts[0], parts[2]], -1))
    grad_parts = [p.clone().requires_grad_() for p in torch.randn(2, 7, 12).split([3, 4, 5], -1)]
    assert joined_columns(grad_parts).grad_fn is not None


def test_dense_as_skips_no_op_casts_only():
    t = torch.randn(4, 6)
    assert dense_as(t, torch.float32) is t
    assert dense_as(t, torch.float64).dtype == torch.float64
    strided = t.t()
    out = dense_as(strided, torch.float32)
    assert out.is_contiguous() and torch.equal(out, strided)


class CatCensus(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.inside, self.cats = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and func.overloadpacket.__name__ in ("cat", "stack"):
            self.cats += 1
        return func(*args, **(kwargs or {}))


def test_serving_short_convs_join_without_concatenating_weights_or_inputs(model, monkeypatch):
    """An engine's steps: each KDA layer's serving short convs make one join (the conv's one buffer of tails and
    inputs), none for the weights, x's parts or the pool's tails (side by side in the pool: read as one view and
    written back as the one tensor they are, no stack either way); tokens stay generate's."""
    census, calls = CatCensus(), collections.Counter()

    def watch(owner, name):
        real = getattr(owner, name)

        def watched(self, *a):
            before, census.inside, calls[name] = census.inside, True, calls[name] + 1
            try:
                return real(self, *a)
            finally:
                census.inside = before
        monkeypatch.setattr(owner, name, watched)
    watch(kda_model.VarlenLayout, "short_convs")
    for name in ("kda_state", "set_kda_state"):
        watch(runner_mod.PagedBatchView, name)
    eng = engine(model, max_batch_tokens=16)
    prompts = [prompt(70, 11), prompt(71, 5)]
    with census:
        outs = eng.generate(prompts, SamplingParams(max_tokens=3, **GREEDY))
    for p, o in zip(prompts, outs):
        assert list(o.output_ids) == reference(model, p, 3)
    assert calls["short_convs"] > 0 and calls["set_kda_state"] == calls["short_convs"]
    assert census.cats == calls["short_convs"], (census.cats, calls)
