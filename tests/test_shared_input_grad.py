"""The input projections' one accumulated input gradient (k3.ops.fused_linear._SharedInputProjections) against
separate nn.Linear calls summed by autograd (K3_NO_SHARED_INPUT_GRAD): a node, each mixer and the MoE, and the
whole tiny model's parameter gradients, in float64; that the sum really happens in the GEMMs (no add op left);
the narrow projections' one GEMM each way;
autocast's casts."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3 import envs
from k3.ops.fused_linear import NARROW_ROWS, FusedLinears, _SharedInputProjections, aligned_rows
from random_model import random_tiny_model as tiny_model


def both_paths(fn):
    """fn() under the shared-gradient path and under autograd's pairwise sums."""
    with envs.override(no_shared_input_grad=False):
        got = fn()
    with envs.override(no_shared_input_grad=True):
        want = fn()
    return got, want


def assert_close_lists(got, want, tol=1e-12):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, i
            continue
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape, i
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("shape,outs,unused", [
    ((5, 16), (8, 3, 16), ()),
    ((2, 7, 24), (24, 1, 40, 5), (1,)),  # an output that takes no part in the loss: no gradient, no zeros
    ((3, 1, 9), (9,), ()),  # a single projection
])
def test_projections_and_gradients_equal_separate_linears(shape, outs, unused):
    gen = torch.Generator().manual_seed(sum(outs))
    D = shape[-1]
    lins = [torch.nn.Linear(D, o, bias=False).double() for o in outs]
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    weights = [torch.randn(*shape[:-1], o, generator=gen, dtype=torch.float64) for o in outs]
    fused = FusedLinears(*lins)

    def run():
        for lin in lins:
            lin.weight.grad = None
        x = x0.clone().requires_grad_()
        ys = fused(x)
        loss = sum((y * w).sum() for i, (y, w) in enumerate(zip(ys, weights)) if i not in unused)
        loss.backward()
        return ys + [x.grad] + [lin.weight.grad for lin in lins]

    got, want = both_paths(run)
    for i in unused:
        assert want[len(outs) + 1 + i] is None  # the reference's own: no gradient reaches the unused weight
    assert_close_lists(got, want)


def test_frozen_weights_and_an_input_without_grad():
    """Only the gradients asked for are formed: x without requires_grad gets none, a frozen weight none."""
    gen = torch.Generator().manual_seed(3)
    lins = [torch.nn.Linear(12, o, bias=False).double() for o in (6, 4)]
    lins[1].weight.requires_grad_(False)
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    w = [torch.randn(4, o, generator=gen, dtype=torch.float64) for o in (6, 4)]

    def run():
        lins[0].weight.grad = None
        ys = FusedLinears(*lins)(x)
        sum((y * wi).sum() for y, wi in zip(ys, w)).backward()
        return [lins[0].weight.grad, lins[1].weight.grad]

    got, want = both_paths(run)
    assert got[1] is None and got[0] is not None
    assert_close_lists(got, want)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


WIDE = NARROW_ROWS + 8  # a projection wider than the narrow ones that share a GEMM


@pytest.mark.parametrize("shared", [True, False])
def test_input_gradient_is_summed_inside_the_gemms(shared):
    """With the shared path the backward of 6 wide projections runs one mm and 5 in-place addmm for ∂L/∂x and
    no separate add; autograd's path (the control: the counter sees what it claims) adds 5 times."""
    lins = [torch.nn.Linear(16, WIDE, bias=False) for _ in range(6)]
    x = torch.randn(10, 16, requires_grad=True)
    with envs.override(no_shared_input_grad=not shared):
        ys = FusedLinears(*lins)(x)
        loss = sum(y.square().sum() for y in ys)
        counter = _OpCounter()
        with counter:
            (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    adds = [op for op in counter.ops if op in ("add", "add_")]
    if shared:
        assert counter.ops.count("addmm_") == 5 and adds == []
    else:
        assert len(adds) == 5 and "addmm_" not in counter.ops
    want = sum(2 * y.detach() @ lin.weight.detach() for y, lin in zip(ys, lins))
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-5)


def test_narrow_projections_share_one_gemm_each_way():
    """KDA's set (four wide, f_a and beta narrow): the narrow two are one GEMM forward (5 products, not 6), one
    product into ∂L/∂x and one for both weight gradients, in float64 equal to separate nn.Linear calls."""
    gen = torch.Generator().manual_seed(8)
    widths = (WIDE, WIDE, WIDE, 24, 3, WIDE)
    lins = [torch.nn.Linear(16, o, bias=False).double() for o in widths]
    x0 = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    probes = [torch.randn(2, 5, o, generator=gen, dtype=torch.float64) for o in widths]

    def run(counter=None):
        for lin in lins:
            lin.weight.grad = None
        x = x0.clone().requires_grad_()
        with counter or contextlib.nullcontext():
            ys = FusedLinears(*lins)(x)
            sum((y * w).sum() for y, w in zip(ys, probes)).backward()
        return ys + [x.grad] + [lin.weight.grad for lin in lins]

    counter = _OpCounter()
    with envs.override(no_shared_input_grad=False):
        got = run(counter)
    with envs.override(no_shared_input_grad=True):
        want = run()
    assert_close_lists(got, want)
    products = [op for op in counter.ops if op in ("mm", "addmm_", "addmm", "bmm")]
    # forward 5; ∂L/∂x: 1 mm + 3 addmm_ (wide) + 1 addmm_ (narrow); ∂L/∂W: 4 wide + 1 narrow
    assert products.count("addmm_") == 4 and len(products) == 5 + 5 + 5, products
    assert got[3]._base is got[4]._base is not None  # f_a's and beta's outputs: views of one product
    with torch.no_grad():  # without a gradient: the same GEMMs, so the same bits (a GPU's kernels differ by shape)
        plain = FusedLinears(*lins)(x0)
    assert plain[3]._base is plain[4]._base is not None
    assert all(torch.equal(a, b.detach()) for a, b in zip(plain, got[:len(widths)]))


def test_autocast_casts_once_and_matches_linear_under_autocast():
    """Under CPU autocast (bf16) the outputs are F.linear's under autocast, bitwise (the same bf16 GEMM), and
    the fp32 weights' and input's gradients come back in fp32, close to the per-call path's."""
    gen = torch.Generator().manual_seed(5)
    lins = [torch.nn.Linear(32, o, bias=False) for o in (16, 8, 24)]
    x0 = torch.randn(2, 6, 32, generator=gen)
    w = [torch.randn(2, 6, o, generator=gen) for o in (16, 8, 24)]

    def run():
        for lin in lins:
            lin.weight.grad = None
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = FusedLinears(*lins)(x)
        sum((y.float() * wi).sum() for y, wi in zip(ys, w)).backward()
        return ys, [x.grad] + [lin.weight.grad for lin in lins]

    (ys, grads), (ys_ref, grads_ref) = both_paths(run)
    for y, r in zip(ys, ys_ref):
        assert y.dtype == torch.bfloat16 and torch.equal(y, r)
    for g, r in zip(grads, grads_ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


def test_node_returns_contiguous_wide_outputs():
    """Each wide output is its own contiguous [.., o_i] tensor (the short conv and the split of kv_a rely on it);
    narrow ones are views of their shared product, its rows padded to ROW_ALIGN."""
    x = torch.randn(3, 5, 8, requires_grad=True)
    ys = _SharedInputProjections.apply(x, torch.randn(4, 8), torch.randn(WIDE, 8), torch.randn(7, 8))
    assert [tuple(y.shape) for y in ys] == [(3, 5, 4), (3, 5, WIDE), (3, 5, 7)] and ys[1].is_contiguous()
    assert ys[0]._base is ys[2]._base and ys[0].stride(1) == aligned_rows(4 + 7) == 16


@pytest.mark.parametrize("layer_idx,part", [(1, "self_attn"), (5, "self_attn"), (2, "block_sparse_moe")])
def test_each_mixer_and_the_moe_equal_the_unshared_path(layer_idx, part):
    """A KDA layer (1), an MLA layer (5: tiny's last) and a MoE: output, input and parameter gradients."""
    model = tiny_model(layer_idx)
    module = getattr(model.model.layers[layer_idx], part)
    assert isinstance(getattr(module, "in_proj", None), FusedLinears)
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 9, model.config.hidden_size, generator=gen, dtype=torch.float64)
    probe = torch.randn(2, 9, model.config.hidden_size, generator=gen, dtype=torch.float64)

    def run():
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = module(x)
        (out * probe).sum().backward()
        return [out, x.grad] + [p.grad for p in module.parameters()]

    got, want = both_paths(run)
    assert want[1] is not None
    assert_close_lists(got, want, tol=1e-10)


def test_tiny_model_parameter_gradients_equal_the_unshared_path():
    model = tiny_model(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    got, want = both_paths(run)
    assert_close_lists(got, want, tol=1e-10)
