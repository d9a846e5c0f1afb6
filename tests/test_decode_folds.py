"""The decoder's residual add `p + ffn` left to the next AttnRes mix at inference (k3.model.decoder): the same
logits as the training forward, which adds it itself, and, with the fused mix + norm kernel on (under Triton's
interpreter on a CPU), a decode step with no add of its own between the layers."""
import os
import sys
from pathlib import Path

import pytest
import torch

from k3 import envs
from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(seed: int, block: int | None = None) -> K3ForCausalLM:
    """`tiny` (fp32, eval) with non-zero AttnRes pseudo-queries (softmaxes that are not means); `block`: the AttnRes
    block size (a block starting mid-stack, where the incoming sum is stored as a block)."""
    cfg = K3Config.preset("tiny")
    if block is not None:
        cfg = cfg.replace(attn_res_block_size=block)
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("block", [1, 2, 4])
def test_inference_forward_equals_the_forward_that_adds_each_ffn_itself(block):
    """No gradient: each layer's FFN output is added by the next mix; with one, by the layer (and BlockGrads).
    The references run the same adds either way, so the logits are equal, at every block size (blocks start at
    every layer, every other, or every fourth), and so are a cached decode's steps. The references on every device
    (on a GPU the kernels would differ between the two forwards: bit equality is the references' property)."""
    model = _model(seed=block, block=block)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), device=DEVICE)
    with envs.override(no_triton="all", no_fla=True), torch.enable_grad():
        trained = model(ids).logits
    with envs.override(no_triton="all", no_fla=True), torch.no_grad():
        inferred = model(ids).logits
        cache = model.new_cache(2, 8)
        model(ids[:, :6], cache=cache)
        step = model(ids[:, 6:], cache=cache).logits[:, -1]
    assert trained.requires_grad
    assert torch.equal(inferred, trained.detach())
    torch.testing.assert_close(step, trained.detach()[:, -1], rtol=1e-5, atol=1e-5)


def test_checkpointed_training_forward_still_adds_each_ffn_itself():
    """The recomputing path (gradient checkpointing) gives the plain training forward's loss and gradients."""
    model = _model(seed=9, block=2).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6), device=DEVICE)
    grads = []
    for checkpointing in (False, True):
        model.model.gradient_checkpointing = checkpointing
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), model.model.layers[1].mlp_res_proj.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-7)


def test_decode_step_adds_each_ffn_output_inside_the_next_mix(monkeypatch):
    """With the fused mix + norm on (forced on CPU tensors, the interpreter runs it): a decode step's AttnRes ops
    (what runs between the mixers and FFNs) are the mix kernels, 2 a layer (layer 0: 1, plus the final mix), and
    no residual add; the logits equal the full forward's."""
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton's import; the census and kernel need it)
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from decode_op_census import Census, kinds_from_modules

    import k3.model.attn_res as attn_res
    from k3.ops import triton_dispatch

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without its interpreter")
    real = triton_dispatch.use_triton_op
    monkeypatch.setattr(attn_res, "use_triton_op",
                        lambda x, name: name == "_attn_res_norm_triton" or real(x, name))
    model = _model(seed=3)
    L = model.config.num_hidden_layers
    B, T = 2, 5
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1), device=DEVICE)
    census = Census()
    # the plain RMSNorm on every device: its `+ eps` is the one add counted below (a GPU norm kernel has none); on a
    # GPU a MoE layer's second mix would launch with its router (`_attn_res_route_triton`): the mix op alone here
    with envs.override(no_triton="_norm_triton,_attn_res_route_triton"), torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = model.new_cache(B, T + 1)
        model(ids[:, :T], cache=cache)
        with kinds_from_modules(model, census), census:
            step = model(ids[:, T:], cache=cache).logits[:, -1]
    attn_res_ops = {op: c for (kind, op), c in census.counts.items() if kind == "AttnRes"}
    assert attn_res_ops["k3::attn_res_mix_norm"] == 2 * L, attn_res_ops
    # the one add left is layer 0's input RMSNorm's `+ eps` (the reference's ops here: it reads the embedding, no
    # mix); a `p + ffn` of its own would be L more
    assert attn_res_ops["aten::add"] == 1 and "aten::add_" not in attn_res_ops, attn_res_ops
    torch.testing.assert_close(step, full, rtol=2e-4, atol=2e-4)


def test_fused_mix_keeps_its_score_weight_until_a_weight_changes(monkeypatch):
    """The fused mix's fp32 u ⊙ w (k3.ops._attn_res_norm_triton.score_weight: two casts and a product in bf16) is
    made once per mix and kept: a second forward makes none; after one pseudo-query changes in place, the next
    forward makes that one again and follows the changed model (== the references' forward), which differs."""
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    import k3.model.attn_res as attn_res
    from k3.ops import triton_dispatch

    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without its interpreter")
    kernels = triton_dispatch.triton_module("_attn_res_norm_triton")
    real = triton_dispatch.use_triton_op
    monkeypatch.setattr(attn_res, "use_triton_op",
                        lambda x, name: name == "_attn_res_norm_triton" or real(x, name))
    made = []
    make = kernels.score_weight
    monkeypatch.setattr(kernels, "score_weight", lambda u, w: made.append(w) or make(u, w))
    model = _model(seed=6)
    L = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 5), device=DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        assert len(made) == 2 * L  # each mix's once (layer 0 has one, the final mix one more)
        model(ids)
        assert len(made) == 2 * L
        changed = model.model.layers[2].mlp_res_proj.weight
        changed.mul_(-1.5)
        got = model(ids).logits
        assert len(made) == 2 * L + 1 and made[-1].data_ptr() == changed.data_ptr()
        monkeypatch.setattr(attn_res, "use_triton_op", real)  # the references
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert not torch.allclose(got, before, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("M,N,K", [(1, 37, 129), (8, 300, 96), (13, 64, 513)])
def test_plain_linear_sums_into_a_scratch_residual(M, N, K):
    """`linear(..., into_residual=True)` off the kernel: x Wᵀ added into the residual in place (one addmm_) and the
    residual returned, equal to the reference's GEMM then add (float64 from the same values), the norm prologue
    included; with a bias, a strided residual or a gradient wanted, the reference's new tensor, the residual
    untouched."""
    from k3.ops.gemv import force_gemv, linear, linear_reference

    g = torch.Generator().manual_seed(M + N + K)
    x, w = torch.randn(M, K, generator=g).to(DEVICE), torch.randn(N, K, generator=g).to(DEVICE)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    res = torch.randn(M, N, generator=g).to(DEVICE)
    for norm in (None, nw):
        want = linear_reference(x.double(), w.double(), None, res.double(), None if norm is None else nw.double(),
                                1e-6)
        scratch = res.clone()
        with force_gemv(False):
            got = linear(x, w, None, scratch, norm, 1e-6, into_residual=True)
        assert got is scratch
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    bias = torch.randn(N, generator=g).to(DEVICE)
    strided = torch.randn(M, 2 * N, generator=g).to(DEVICE)[:, ::2]
    w_grad = w.clone().requires_grad_()
    for args in ((x, w, bias, res.clone()), (x, w, None, strided), (x, w_grad, None, res.clone())):
        before = args[3].detach().clone()
        with force_gemv(False):
            got = linear(*args, into_residual=True)
        assert got is not args[3] and torch.equal(args[3], before)
        torch.testing.assert_close(got.detach(), linear_reference(*args).detach())


def test_moe_adds_the_shared_output_inside_the_up_projection_gemm():
    """A tiny LatentMoE at 8 decode rows, the GEMV off (on a GPU it takes tiny's small weights at 8 rows: the
    plain path, cuBLAS's), sums the routed up projection into the shared experts' output in its GEMM: one addmm_
    and no add of [8, D] rows; the layer equals the same layer run with a gradient wanted (F.linear + add)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3.model.moe import LatentMoE
    from k3.ops.gemv import force_gemv

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.seen.append((func._schema.name, tuple(out.shape)))
            return out

    cfg = K3Config.preset("tiny")
    torch.manual_seed(2)
    moe = LatentMoE(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(8, 1, cfg.hidden_size, device=DEVICE)
    runs = {}
    for grad in (False, True):
        ops = Ops()
        with torch.set_grad_enabled(grad), force_gemv(False), ops:
            runs[grad] = (moe(x), ops.seen)
    rows = (8, cfg.hidden_size)
    assert ("aten::addmm_", rows) in runs[False][1] and ("aten::add", rows) not in runs[False][1]
    assert ("aten::addmm_", rows) not in runs[True][1] and ("aten::add", rows) in runs[True][1]
    torch.testing.assert_close(runs[False][0], runs[True][0].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [2, 8, 40])
def test_bf16_moe_hands_the_routers_fp32_weights_to_its_experts(rows, monkeypatch):
    """A bf16 tiny LatentMoE at inference: the router's fp32 weights reach the layer's own experts seam uncast (no
    fp32 -> bf16 copy of the [N, k] weights before it, which the decode kernels would cast back: two launches a
    layer), and the output equals the same layer whose seam is handed bf16 weights (the casting forward before
    this fold, kept for a replaced seam) at bf16 tolerance. 2 rows: the selected-experts decode path; 8 and 40:
    expert-major's rule or the grouped path, whose product casts them itself."""
    import k3.model.moe as moe_module
    from k3.model.moe import LatentMoE

    cfg = K3Config.preset("tiny")
    torch.manual_seed(3)
    moe = LatentMoE(cfg).to(DEVICE, torch.bfloat16).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    handed = []
    real = LatentMoE.combine_experts

    def seam(self, z, idx, w, meanwhile=None):
        handed.append(w.dtype)
        return real(self, z, idx, w, meanwhile)

    monkeypatch.setattr(LatentMoE, "combine_experts", seam)
    real_tail = moe_module.selected_experts_tail

    def tail(z, idx, w, *rest):  # on a GPU the expert-major kernels' tail takes 40 rows, past the seam
        out = real_tail(z, idx, w, *rest)
        if out is not None:
            handed.append(w.dtype)
        return out

    monkeypatch.setattr(moe_module, "selected_experts_tail", tail)
    x = torch.randn(rows, 1, cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        got = moe(x)
        assert handed == [torch.float32]
        moe.combine_experts = lambda z, idx, w, meanwhile=None: seam(moe, z, idx, w, meanwhile)  # a replaced seam
        cast_first = moe(x)
    assert handed[-1] == torch.bfloat16
    scale = cast_first.float().abs().max().item()
    torch.testing.assert_close(got.float(), cast_first.float(), rtol=2 ** -6, atol=2 ** -6 * scale)


@pytest.mark.parametrize("seed", [3, 4])
def test_dense_mlp_joins_gate_and_up_at_one_row(seed):
    """Layer 0's dense SiTU MLP at inference: with the stacked weight on (fuse_projections), one row (a batch-1
    decode step) takes gate and up as one GEMM, neither linear called, and equals the two GEMMs' output; at 3 rows
    (odd) the two GEMMs run (the joined halves would be copied), same output. The MoE's shared experts keep no
    stack of their own (their gate and up sit in the MoE's input projections)."""
    from k3.ops.fused_linear import fuse_projections

    model = _model(seed=seed)
    mlp = model.model.layers[0].mlp
    assert mlp.in_proj is not None
    assert all(layer.block_sparse_moe.shared_experts.in_proj is None
               for layer in model.model.layers[1:] if getattr(layer.block_sparse_moe, "shared_experts", None))
    D = model.config.hidden_size
    with torch.no_grad():
        xs = [torch.randn(1, 1, D, device=DEVICE), torch.randn(3, 1, D, device=DEVICE)]
        want = [mlp(x) for x in xs]  # stack off: the two GEMMs
        fuse_projections(model)
        calls = []
        hook = mlp.gate_proj.register_forward_hook(lambda *a: calls.append(1))
        for x, base, joined in zip(xs, want, (True, False)):
            calls.clear()
            torch.testing.assert_close(mlp(x), base, rtol=1e-5, atol=1e-5)
            assert len(calls) == (0 if joined else 1)
        hook.remove()
