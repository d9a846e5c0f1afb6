"""The AttnRes sources' gradients summed in one buffer each by the mixes' backwards, the residual adds'
included (k3.model.attn_res.BlockGrads), against autograd's pairwise sums (K3_NO_BLOCK_GRAD_BUFFER): the tiny
model's parameter and input gradients in float64 on the torch path (with and without activation
checkpointing), the fused kernel's accumulating backward under the Triton interpreter, the model through the
fused mixes, and the adds it removes. On CUDA the kernels run natively; the Triton tests skip where triton is
not installed."""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import

from k3 import K3Config, envs  # noqa: E402
from k3.model import attn_res  # noqa: E402
from k3.model import norm as norm_module  # noqa: E402
from random_model import random_tiny_model as tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gradients(model, ids, embeds=None):
    """[loss, ∂L/∂inputs_embeds or None, every parameter's gradient] of one training forward."""
    model.zero_grad(set_to_none=True)
    x = None if embeds is None else embeds.clone().requires_grad_()
    loss = model(ids, labels=ids, inputs_embeds=x).loss
    loss.backward()
    return [loss.detach(), None if x is None else x.grad] + [p.grad for p in model.parameters()]


def both_paths(fn):
    with envs.override(no_block_grad_buffer=False):
        got = fn()
    with envs.override(no_block_grad_buffer=True):
        want = fn()
    return got, want


def assert_all_close(got, want, tol):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None, i
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype, i
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("with_embeds", [False, True])
def test_tiny_model_gradients_equal_autograds_sums(checkpointing, with_embeds):
    """Every parameter's gradient, and the input embeddings' (layer 0's norm reads them besides the mixes)."""
    model = tiny_model(2)
    model.model.gradient_checkpointing = checkpointing
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=gen)
    embeds = torch.randn(2, 10, model.config.hidden_size, generator=gen, dtype=torch.float64) if with_embeds else None
    got, want = both_paths(lambda: gradients(model, ids, embeds))
    assert (want[1] is not None) == with_embeds
    assert_all_close(got, want, 1e-10)


def test_a_pass_that_stops_short_leaves_nothing_behind():
    """torch.autograd.grad of the last layer's weights only (retain_graph) runs the later mixes' backwards,
    which add into the blocks' buffers, but never the blocks' own nodes; the full backward after it must not
    add onto those partial sums: its gradients equal a fresh model's."""
    model = tiny_model(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    last = model.model.layers[-1].mlp_res_proj.weight

    def run(stop_short_first):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        if stop_short_first:
            torch.autograd.grad(loss, [last], retain_graph=True)
        loss.backward()
        return [p.grad for p in model.parameters()]

    with envs.override(no_block_grad_buffer=True):
        want = run(False)
    with envs.override(no_block_grad_buffer=False):
        assert_all_close(run(True), want, 1e-10)


def test_no_buffer_without_gradients():
    """Inference (no_grad) never builds BlockGrads: the blocks are the plain tensors."""
    seen = []
    real = attn_res.BlockGrads.attach
    model = tiny_model(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    attn_res.BlockGrads.attach = lambda self, b: seen.append(b) or real(self, b)
    try:
        with torch.no_grad():
            model(ids)
        assert seen == []
        model(ids)
        # the control: with gradients the embedding (the first block) and every partial sum (two a layer:
        # after the attention and after the MLP) is attached, each once: a later block is a partial sum, which
        # the mix that adds it attaches
        L = model.config.num_hidden_layers
        assert len(seen) == 1 + 2 * L
        assert len({id(t) for t in seen}) == len(seen)
    finally:
        attn_res.BlockGrads.attach = real


# ---- the fused kernels (Triton; the interpreter on CPU) -------------------------------------------------------
def kernels():
    pytest.importorskip("triton")
    from k3.ops import _attn_res_triton
    return _attn_res_triton


@pytest.mark.parametrize("n,B,T,D,dtype", [
    (2, 2, 5, 64, torch.float32),
    (4, 1, 19, 96, torch.float32),  # D not a power of two, rows not a multiple of the tile
    (3, 2, 7, 128, torch.bfloat16),
])
def test_backward_adds_into_the_given_buffers(n, B, T, D, dtype):
    """mix_backward with `into`: a source with (buffer, accumulate=True) gets buffer + its gradient, one with
    (buffer, False) gets its gradient written over the buffer's old contents (NaN here), the rest fresh ones;
    every value against the reference's gradients."""
    ar = kernels()
    gen = torch.Generator().manual_seed(n * 100 + D)
    sources = [(torch.randn(B, T, D, generator=gen) * (i + 1)).to(DEVICE, dtype) for i in range(n)]
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (torch.randn(1, D, generator=gen) * 0.5).to(DEVICE)
    g = torch.randn(B, T, D, generator=gen).to(DEVICE, dtype)
    _, scores, lse = ar.mix_forward(u, w, 1e-5, tuple(sources))
    _, _, fresh = ar.mix_backward(g, u, w, 1e-5, tuple(sources), scores, lse)
    prior = torch.randn(B, T, D, generator=gen).to(DEVICE, dtype)
    buf0 = prior.clone()
    into = [(buf0, buf0), (torch.full_like(sources[1], float("nan")), None)] + [None] * (n - 2)
    du, dw, grads = ar.mix_backward(g, u, w, 1e-5, tuple(sources), scores, lse, into=into)
    assert grads[0] is into[0][0] and grads[1] is into[1][0]  # written where asked, no new tensor
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grads[0].float(), (prior.float() + fresh[0].float()), rtol=tol, atol=tol)
    torch.testing.assert_close(grads[1], fresh[1], rtol=0, atol=0)
    for a, b in zip(grads[2:], fresh[2:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _AddCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.adds += func.overloadpacket.__name__ in ("add", "add_")
        return func(*args, **(kwargs or {}))


def block_uses(config: K3Config) -> list[int]:
    """How many mixes read each AttnRes block (SPEC §3.1's loop): a block stored before layer l is read by the
    layer's attention mix (if any block precedes it) and its MLP mix; the block a layer starts is read by that
    layer's attention mix as its partial sum; all of them by the output mix."""
    size, L = config.attn_res_block_size, config.num_hidden_layers
    uses = []
    for start in range(0, L, size):
        n = 1  # the output mix
        for l in range(start, L):
            n += 1  # the MLP mix
            n += l > 0  # the attention mix (layer 0 has none: no block precedes it)
        uses.append(n)
    return uses


def test_the_mix_norm_fold_switch():
    assert [envs.parse(env).no_mix_norm_fold for env in ({}, {"K3_NO_MIX_NORM_FOLD": "0"},
                                                         {"K3_NO_MIX_NORM_FOLD": "1"})] == [False, False, True]


def test_the_residual_add_fold_switch():
    """K3_NO_RESIDUAL_ADD_FOLD: off unset, empty or "0"; on for "1"."""
    assert [envs.parse(env).no_residual_add_fold for env in ({}, {"K3_NO_RESIDUAL_ADD_FOLD": ""},
                                                             {"K3_NO_RESIDUAL_ADD_FOLD": "0"},
                                                             {"K3_NO_RESIDUAL_ADD_FOLD": "1"})] == [False] * 3 + [True]


def test_model_through_the_fused_mixes(monkeypatch):
    """The tiny model (float32) with its mixes on the fused kernels (forced on for CPU tensors under the
    interpreter; every other kernel as on CPU) and each residual add in the launch of the mix that reads its sum
    (`_AttnResAddMixFused`): the loss and every gradient as with the buffer off and the adds separate
    (K3_NO_RESIDUAL_ADD_FOLD); the forward's adds fewer by one per residual add onto a partial sum (two a layer,
    but one in a layer that starts a block: its partial sum starts as the attention output, no add), and
    autograd's adds in backward fewer by exactly Σ(readers − 1) over the blocks plus that same count."""
    kernels()
    real_use = attn_res.use_triton
    monkeypatch.setattr(attn_res, "use_triton", lambda x, name: name == "_attn_res_triton" or real_use(x, name))
    model = tiny_model(3, torch.float32, DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def run(fold_adds: bool):
        model.zero_grad(set_to_none=True)
        forward, backward = _AddCounter(), _AddCounter()
        with envs.override(no_residual_add_fold=not fold_adds, no_mix_norm_fold=True), forward:
            loss = model(ids, labels=ids).loss
        with backward:
            loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()], forward.adds, backward.adds

    with envs.override(no_block_grad_buffer=False):
        got, fwd_adds, adds = run(True)
    with envs.override(no_block_grad_buffer=True):
        want, fwd_adds_ref, adds_ref = run(False)
    assert_all_close(got, want, 2e-5)
    L, uses = model.config.num_hidden_layers, block_uses(model.config)
    residual_adds = 2 * L - len(uses)
    assert fwd_adds_ref - fwd_adds == residual_adds == 10
    assert adds_ref - adds == sum(n - 1 for n in uses) + residual_adds == 27  # tiny: 12 and 7 readers, 10


def test_the_norm_fold_takes_each_folded_mixs_norm(monkeypatch):
    """The tiny model (float32) on the fused mixes, each one taking the RMSNorm after it (K3_NO_MIX_NORM_FOLD
    unset), with its residual add or without (a block's first MLP mix): the loss and every gradient (the norms'
    weights included) as with the norms separate, and one RMSNorm call fewer a mix (two a layer but layer 0's
    attention, which reads no mix, plus the output's)."""
    kernels()
    real_use = attn_res.use_triton
    monkeypatch.setattr(attn_res, "use_triton", lambda x, name: name == "_attn_res_triton" or real_use(x, name))
    norms = []
    real_norm = norm_module.rms_norm
    monkeypatch.setattr(norm_module, "rms_norm", lambda *a: norms.append(1) or real_norm(*a))
    model = tiny_model(6, torch.float32, DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run(fold: bool):
        model.zero_grad(set_to_none=True)
        norms.clear()
        with envs.override(no_mix_norm_fold=not fold):
            loss = model(ids, labels=ids).loss
            loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()], len(norms)

    (got, calls), (want, calls_ref) = run(True), run(False)
    assert_all_close(got, want, 2e-5)
    assert calls_ref - calls == 2 * model.config.num_hidden_layers == 12


def test_model_through_the_fused_mixes_with_checkpointing(monkeypatch):
    """As above with each layer recomputed in backward (its attention's residual add in the fused mix, run again
    by the recomputation): every gradient as with the buffer off and the adds separate."""
    kernels()
    real_use = attn_res.use_triton
    monkeypatch.setattr(attn_res, "use_triton", lambda x, name: name == "_attn_res_triton" or real_use(x, name))
    folded = []
    real_apply = attn_res._AttnResAddMixFused.apply
    monkeypatch.setattr(attn_res._AttnResAddMixFused, "apply", lambda *a: folded.append(1) or real_apply(*a))
    model = tiny_model(5, torch.float32, DEVICE)
    model.model.gradient_checkpointing = True
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def run():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    with envs.override(no_block_grad_buffer=False):
        got = run()
    with envs.override(no_block_grad_buffer=True, no_residual_add_fold=True):
        want = run()
    L, starts = model.config.num_hidden_layers, len(block_uses(model.config))
    assert len(folded) == 2 * (L - starts)  # each layer's attention add, in the forward and in its recomputation
    assert_all_close(got, want, 2e-5)
