"""The MoE's sum over each token's k expert rows (k3.ops.slot_sum): the Triton kernels against the float64 torch
reference, values and gradients (y and the weights), with and without weights, at odd sizes; the reference
against the model's combine before it (a gather then a batched product). Without CUDA the kernels run on CPU
under the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from k3.ops import _slot_sum_triton, slot_sum  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(seed, N, k, L, dtype):
    """y in expert order [N·k, L], slot = where each (token, choice) sits (a random permutation), weights [N, k],
    and the output's gradient."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(N * k, L, generator=g).to(dtype)
    slot = torch.randperm(N * k, generator=g).view(N, k)
    w = torch.rand(N, k, generator=g).to(dtype)
    dout = torch.randn(N, L, generator=g).to(dtype)
    return (t.to(DEVICE) for t in (y, slot, w, dout))


def value_and_grads(fn, y, slot, w, dout):
    leaves = [y.detach().clone().requires_grad_()] + ([] if w is None else [w.detach().clone().requires_grad_()])
    out = fn(leaves[0], slot, leaves[1] if w is not None else None)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("seed,N,k,L", [(1, 37, 8, 96), (2, 1, 1, 5), (3, 9, 3, 200), (4, 6, 8, 768),
                                        (5, 13, 2, 33)])
def test_kernels_match_float64(seed, N, k, L, weighted):
    """fp32 inputs through the kernels (odd N and L, L past one forward block, k 1..8) against the float64
    reference: the sum, ∂L/∂y (every row of it written: slot is a permutation) and ∂L/∂w."""
    y, slot, w, dout = case(seed, N, k, L, torch.float32)
    w = w if weighted else None
    got = value_and_grads(slot_sum._SlotSum.apply, y, slot, w, dout)
    as64 = lambda t: None if t is None else t.double()  # noqa: E731
    want = value_and_grads(slot_sum.slot_sum_reference, as64(y), slot, as64(w), as64(dout))
    assert len(got) == len(want) == 2 + weighted
    for name, a, b in zip(("out", "grad_y", "grad_w"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * L ** 0.5, msg=lambda m: f"{name}: {m}")


def test_bf16_kernels_are_no_further_from_float64_than_the_torch_form():
    """bf16 as training runs it: the kernels sum in fp32 and round once; held to float64 truth, their error may
    not exceed the reference's (which rounds the same fp32 sum) by more than an ulp of the output."""
    y, slot, w, dout = case(7, 29, 8, 160, torch.bfloat16)
    got = value_and_grads(slot_sum._SlotSum.apply, y, slot, w, dout)
    ref = value_and_grads(slot_sum.slot_sum_reference, y, slot, w, dout)
    truth = value_and_grads(slot_sum.slot_sum_reference, y.double(), slot, w.double(), dout.double())
    for name, a, b, t in zip(("out", "grad_y", "grad_w"), got, ref, truth):
        assert a.dtype == torch.bfloat16, name
        err, err_ref = ((v.double() - t).abs().max().item() for v in (a, b))
        assert err <= err_ref + 2.0 ** -7 * t.abs().max().item(), (name, err, err_ref)


def test_reference_is_the_weighted_sum_over_the_slots():
    """The reference against a loop over tokens and choices, float64 (the reference's batched product and the
    loop's multiply-adds may differ only in summation order)."""
    y, slot, w, _ = case(8, 11, 4, 24, torch.float64)
    loop = torch.stack([sum(w[n, j] * y[slot[n, j]] for j in range(4)) for n in range(11)])
    torch.testing.assert_close(slot_sum.slot_sum_reference(y, slot, w), loop)
    torch.testing.assert_close(slot_sum.slot_sum_reference(y, slot), torch.stack([y[s].sum(0) for s in slot]))


@pytest.mark.parametrize("kernels", [True, False])
def test_combine_rows_matches_float64_both_ways(monkeypatch, kernels):
    """The MoE's combine entry, with the kernels and with the torch fallback (the gather through
    token_permute and a batched product): values and both gradients against the float64 reference."""
    from k3.ops.token_permute import inverse_permutation

    monkeypatch.setattr(slot_sum, "use_triton", lambda t, name: kernels and name == "_slot_sum_triton")
    y, slot, w, dout = case(11, 13, 4, 40, torch.float32)
    order = inverse_permutation(slot.flatten())
    got = value_and_grads(lambda y_, s_, w_: slot_sum.combine_rows(y_, w_, s_.flatten(), order), y, slot, w, dout)
    want = value_and_grads(slot_sum.slot_sum_reference, y.double(), slot, w.double(), dout.double())
    for name, a, b in zip(("out", "grad_y", "grad_w"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")
    y16, dout16 = y.to(torch.bfloat16), dout.to(torch.bfloat16)  # bf16 rows, fp32 routing weights (as the MoE)
    got = value_and_grads(lambda y_, s_, w_: slot_sum.combine_rows(y_, w_, s_.flatten(), order), y16, slot, w, dout16)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, a, b in zip(("out", "grad_y", "grad_w"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=3e-2, msg=lambda m: f"{name} (bf16): {m}")


def test_only_the_gradients_asked_for_are_written(monkeypatch):
    """w without a gradient: the kernel is asked for ∂L/∂y alone; y without one: ∂L/∂w alone."""
    calls = []
    real = _slot_sum_triton.slot_sum_backward
    monkeypatch.setattr(_slot_sum_triton, "slot_sum_backward", lambda *a: calls.append(a[-2:]) or real(*a))
    y, slot, w, dout = case(9, 5, 3, 16, torch.float32)
    (gy,) = torch.autograd.grad(slot_sum._SlotSum.apply(y.requires_grad_(), slot, w), y, dout)
    (gw,) = torch.autograd.grad(slot_sum._SlotSum.apply(y.detach(), slot, w.requires_grad_()), w, dout)
    assert calls == [(True, False), (False, True)]
    want_y, want_w = torch.autograd.grad(slot_sum.slot_sum_reference(y, slot, w), (y, w), dout)
    torch.testing.assert_close(gy, want_y)
    torch.testing.assert_close(gw, want_w, rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_to_the_reference_where_the_kernels_do_not_run(monkeypatch):
    """On CPU (or with the kernels switched off) `slot_sum` is the reference; where y needs a gradient and slot
    is not a permutation of its rows (N · k != M), the kernels' backward would leave rows unwritten: the
    reference too, even where the kernels run."""
    monkeypatch.setattr(slot_sum, "use_triton", lambda t, name: name == "_slot_sum_triton")
    taken = []
    monkeypatch.setattr(slot_sum, "_slot_sum_kernels", lambda *a: taken.append(1) or slot_sum.slot_sum_reference(*a))
    y, slot, w, _ = case(10, 4, 2, 8, torch.float32)
    slot_sum.slot_sum(y, slot, w)
    slot_sum.slot_sum(y[:6].requires_grad_(), slot % 6, w)  # 8 slots over 6 rows, y needs a gradient
    slot_sum.slot_sum(y[:6], slot % 6, w)  # no gradient: any rows may be read
    assert taken == [1, 1]


@pytest.mark.parametrize("entry", ["slot_sum", "combine_rows"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_input_needs_grad"])
def test_without_gradients_the_forward_kernel_runs_alone(monkeypatch, entry, mode):
    """No input needing a gradient (or grad mode off): the forward kernel alone, not `_SlotSum.apply` (its host
    cost, issue 21): no autograd node on the output, and the value is the reference's."""
    monkeypatch.setattr(slot_sum, "use_triton", lambda t, name: name == "_slot_sum_triton")
    monkeypatch.setattr(slot_sum._SlotSum, "apply", lambda *a: pytest.fail("went through _SlotSum.apply"))
    runs = []
    forward = _slot_sum_triton.slot_sum_forward
    monkeypatch.setattr(_slot_sum_triton, "slot_sum_forward", lambda *a: runs.append(1) or forward(*a))
    y, slot, w, _ = case(11, 9, 4, 40, torch.float32)
    if mode != "no_input_needs_grad":
        y, w = y.requires_grad_(), w.requires_grad_()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "no_input_needs_grad": torch.enable_grad}[mode]
    with context():
        out = call_entry(entry, y, slot, w)
    assert runs == [1] and out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, slot_sum.slot_sum_reference(y.detach(), slot, w.detach()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", ["slot_sum", "combine_rows"])
@pytest.mark.parametrize("needs", ["y", "w", "both"])
def test_with_gradients_the_kernels_go_through_autograd(monkeypatch, entry, needs):
    """Where y or w needs a gradient (grad mode on), `_SlotSum` records the node: the output, ∂L/∂y and ∂L/∂w
    equal the float64 reference's."""
    monkeypatch.setattr(slot_sum, "use_triton", lambda t, name: name == "_slot_sum_triton")
    calls, apply = [], slot_sum._SlotSum.apply
    monkeypatch.setattr(slot_sum._SlotSum, "apply", lambda *a: calls.append(1) or apply(*a))
    y, slot, w, dout = case(12, 7, 3, 50, torch.float32)
    leaves = {"y": [y], "w": [w], "both": [y, w]}[needs]
    got_in = [t.detach().clone().requires_grad_(any(t is l for l in leaves)) for t in (y, w)]
    out = call_entry(entry, got_in[0], slot, got_in[1])
    assert calls == [1] and out.grad_fn is not None
    got = torch.autograd.grad(out, [t for t in got_in if t.requires_grad], dout)
    want_in = [t.detach().double().requires_grad_(any(t is l for l in leaves)) for t in (y, w)]
    want_out = slot_sum.slot_sum_reference(want_in[0], slot, want_in[1])
    want = torch.autograd.grad(want_out, [t for t in want_in if t.requires_grad], dout.double())
    torch.testing.assert_close(out.detach().double(), want_out.detach(), rtol=1e-5, atol=1e-5)
    assert len(got) == len(want) == len(leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def call_entry(entry, y, slot, w):
    """`slot_sum(y, slot, w)`, or the MoE's `combine_rows` on the same sum (slot flattened, with its inverse)."""
    if entry == "slot_sum":
        return slot_sum.slot_sum(y, slot, w)
    flat = slot.flatten()
    return slot_sum.combine_rows(y, w, flat, torch.argsort(flat))


@pytest.mark.parametrize("kernel,consts", [
    ("_slot_sum_fwd_kernel", dict(HAS_W=True, ROWS=_slot_sum_triton.FWD_ROWS, BLOCK_L=_slot_sum_triton.FWD_BLOCK_L)),
    ("_slot_sum_bwd_kernel", dict(NEED_DY=True, NEED_DW=True, ROWS=_slot_sum_triton.BWD_ROWS, BLOCK_L=1024))])
def test_kernels_compile_for_sm90_without_spills(kernel, consts):
    """Both kernels at `small`'s training launch (bf16, k 8, latent 768) compile for the H200 (no GPU:
    tests/sm90_compile.py), the k rows' loads held in registers: no spills in ptxas's allocation."""
    from sm90_compile import ptx_for_sm90, registers_for_sm90

    sig = {"y_ptr": "*bf16", "slot_ptr": "*i64", "w_ptr": "*bf16"}
    sig.update({"out_ptr": "*bf16"} if "fwd" in kernel else {"dout_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*bf16"})
    sig = {**sig, "N": "i32", "L": "i32"}
    ptx = ptx_for_sm90("k3.ops._slot_sum_triton", kernel, sig, num_warps=_slot_sum_triton.NUM_WARPS, K=8, **consts)
    assert "ld.global" in ptx and "st.global" in ptx
    assert registers_for_sm90("k3.ops._slot_sum_triton", kernel, sig, num_warps=_slot_sum_triton.NUM_WARPS, K=8,
                              **consts)["STACK"] == 0  # no spills


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_layer_with_the_kernels_equals_its_torch_path(monkeypatch, seed):
    """`tiny`'s LatentMoE in training (fp32), forward and backward, with the slot sum kernels (the combine and
    the dispatch gather's backward) and without: the output, x's gradient and every parameter's gradient agree,
    and the kernels did run, once for each use."""
    from k3.config import K3Config
    from k3.model.moe import LatentMoE

    torch.manual_seed(seed)
    moe = LatentMoE(K3Config.preset("tiny")).to(DEVICE).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 9, moe.gate.weight.shape[1], device=DEVICE)
    calls, kernels = [], slot_sum._slot_sum_kernels
    monkeypatch.setattr(slot_sum, "_slot_sum_kernels", lambda *a: calls.append(a[2] is None) or kernels(*a))

    def grads(kernels):
        monkeypatch.setattr(slot_sum, "use_triton", lambda t, name: kernels and name == "_slot_sum_triton")
        moe.zero_grad()
        xs = x.clone().requires_grad_()
        out = moe(xs)
        out.backward(out.detach() + 0.3)
        return [out.detach(), xs.grad] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]

    fast, plain = grads(True), grads(False)
    assert calls == [False, True]  # the combine (weighted), then the dispatch's backward (no weights)
    assert len(fast) == len(plain) > 3
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
