"""Activation memory: the memory-saving rewrites (AttnRes mix, loss, MoE combine) equal the formulas they replace
in float64, and per-layer activation checkpointing gives the same gradients and balancer statistics while keeping
far fewer bytes for backward (measured with benchmarks/activation_memory.py's saved-tensor hooks)."""
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3 import K3Config, K3ForCausalLM
from k3.balance import ExpertBalancer
from k3.model.attn_res import attn_res_mix
from k3.model.moe import LatentMoE
from k3.model.norm import RMSNorm
from k3.ops import cross_entropy as ce_mod
from k3.ops.norm import rms_norm
from test_model import make_model, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import activation_memory  # noqa: E402

TOL = dict(rtol=1e-11, atol=1e-12)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- AttnRes mix ---------------------------------------------------------------------------------------------
def stacked_mix(sources, norm, proj):
    """The formula attn_res_mix replaced: autograd through an fp32 (fp64) [n, B, T, D] stack."""
    dt = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    v = torch.stack(sources).to(dt)
    scores = rms_norm(v, norm.weight, norm.eps) @ proj.weight[0].to(dt)
    return torch.einsum("nbt,nbtd->btd", torch.softmax(scores, dim=0), v).to(sources[0].dtype)


def mix_inputs(seed, n, B, T, D, dtype=torch.float64):
    g = gen(seed)
    sources = [(torch.randn(B, T, D, generator=g, dtype=torch.float64) * (1 + i)).to(dtype) for i in range(n)]
    norm, proj = RMSNorm(D).double(), torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64))
        proj.weight.copy_(torch.randn(1, D, generator=g, dtype=torch.float64))
    return sources, norm.to(dtype), proj.to(dtype), torch.randn(B, T, D, generator=g, dtype=torch.float64).to(dtype)


def value_and_grads(fn, sources, norm, proj, grad_out):
    leaves = [s.clone().requires_grad_() for s in sources]
    norm.zero_grad(set_to_none=True)
    proj.zero_grad(set_to_none=True)
    out = fn(leaves, norm, proj)
    out.backward(grad_out)
    return out.detach(), [s.grad for s in leaves] + [norm.weight.grad, proj.weight.grad]


@pytest.mark.parametrize("seed,n,B,T,D", [(0, 1, 2, 3, 8), (1, 2, 1, 5, 16), (2, 3, 2, 4, 32), (3, 5, 3, 7, 24)])
def test_attn_res_mix_equals_the_stacked_formula(seed, n, B, T, D):
    args = mix_inputs(seed, n, B, T, D)
    want, want_grads = value_and_grads(stacked_mix, *args)
    got, got_grads = value_and_grads(attn_res_mix, *args)
    assert torch.equal(got, want)  # same ops in the same order
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_attn_res_mix_bf16_gradients_match_the_float64_formula():
    sources, norm, proj, grad_out = mix_inputs(7, 4, 2, 6, 64, torch.bfloat16)
    got, got_grads = value_and_grads(attn_res_mix, sources, norm, proj, grad_out)
    assert torch.equal(got, stacked_mix(sources, norm, proj))
    _, want_grads = value_and_grads(stacked_mix, [s.double() for s in sources], copy.deepcopy(norm).double(),
                                    copy.deepcopy(proj).double(), grad_out.double())
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_attn_res_mix_stays_fp32_under_autocast():
    """The trainer runs CUDA steps under bf16 autocast; the mix (whose backward assumes fp32) must not follow it."""
    sources, norm, proj, _ = mix_inputs(3, 3, 2, 5, 64, torch.float32)
    want = attn_res_mix(sources, norm, proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn_res_mix(sources, norm, proj)
    assert torch.equal(got, want)


def test_attn_res_mix_keeps_no_stacked_copy():
    sources, norm, proj, _ = mix_inputs(0, 4, 2, 16, 64, torch.float32)
    sources = [s.requires_grad_() for s in sources]
    existing = {t.untyped_storage().data_ptr() for t in sources + [norm.weight, proj.weight]}
    sizes = {}
    for fn in (stacked_mix, attn_res_mix):
        seen = set()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in existing:
                seen.add((ptr, t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(sources, norm, proj)
        sizes[fn] = sum(b for _, b in seen)
    stack = 4 * 2 * 16 * 64 * 4
    assert sizes[stacked_mix] >= 2 * stack  # the fp32 stack and the normalised keys at least
    assert sizes[attn_res_mix] <= 2 * 4 * 2 * 16 * 4  # only scores and softmax weights, [n, B, T] each


# ---- loss ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,N,V,ignored,chunk", [(0, 7, 11, 0, 1 << 26), (1, 20, 33, 5, 64), (2, 16, 50, 3, 100),
                                                    (3, 9, 5, 9, 7)])
def test_cross_entropy_equals_torch(seed, N, V, ignored, chunk, monkeypatch):
    monkeypatch.setattr(ce_mod, "CHUNK_ELEMENTS", chunk)  # several row chunks, a ragged last one
    g = gen(seed)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[:ignored]] = -100
    scale = float(torch.rand((), generator=g, dtype=torch.float64)) + 0.5
    res = []
    for fn in (lambda x: F.cross_entropy(x, labels, ignore_index=-100), lambda x: ce_mod.chunked_cross_entropy(x, labels)):
        x = logits.clone().requires_grad_()
        loss = fn(x)
        (loss * scale).backward()
        res.append((loss.detach(), x.grad))
    (want, want_grad), (got, got_grad) = res
    if ignored == N:  # nothing to average: nan loss and zero gradient, as torch gives
        assert got.isnan() and want.isnan() and torch.equal(got_grad, want_grad)
    else:
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_cross_entropy_bf16_logits_give_torchs_fp32_loss_and_gradient():
    g = gen(5)
    logits = torch.randn(12, 40, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 40, (12,), generator=g)
    labels[3] = -100
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want, got = F.cross_entropy(a.float(), labels), ce_mod.chunked_cross_entropy(b, labels)
    want.backward()
    got.backward()
    assert got.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=1e-2, atol=1e-6)


# ---- MoE combine ---------------------------------------------------------------------------------------------
def index_add_combine(moe, z, idx, w):
    """The combine LatentMoE.combine_experts replaced: index_add_ of the weighted rows (keeps them for backward)."""
    from k3.ops.grouped_mm import expert_situ_mlp
    N, k = idx.shape
    order = torch.argsort(idx.flatten(), stable=True)
    counts = torch.bincount(idx.flatten(), minlength=moe.num_experts)
    e = moe.experts
    y = expert_situ_mlp(z[order // k], counts, e.w1, e.w3, e.w2, *moe.betas) * w.flatten()[order, None]
    return torch.zeros_like(z).index_add_(0, order // k, y)


@pytest.mark.parametrize("seed,N", [(0, 1), (1, 9), (2, 33)])
def test_moe_combine_equals_index_add(seed, N):
    cfg = K3Config.preset("tiny")
    torch.manual_seed(seed)
    moe = LatentMoE(cfg).double()
    g = gen(seed)
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    z = torch.randn(N, cfg.routed_expert_hidden_size, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_token] for _ in range(N)])
    w = torch.rand(N, cfg.num_experts_per_token, generator=g, dtype=torch.float64)
    grad_out = torch.randn(N, cfg.routed_expert_hidden_size, generator=g, dtype=torch.float64)
    res = []
    for fn in (index_add_combine, lambda m, *a: m.combine_experts(*a)):
        zz, ww = z.clone().requires_grad_(), w.clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        out = fn(moe, zz, idx, ww)
        out.backward(grad_out)
        res.append([out.detach(), zz.grad, ww.grad] + [p.grad for p in moe.experts.parameters()])
    for got, want in zip(res[1], res[0]):
        torch.testing.assert_close(got, want, **TOL)


# ---- activation checkpointing --------------------------------------------------------------------------------
def loss_and_grads(model, ids, checkpointing, **kw):
    model.zero_grad(set_to_none=True)
    model.model.gradient_checkpointing = checkpointing
    loss = model(ids, labels=ids, **kw).loss
    scores = [m.last_scores.clone() for m in model.modules() if isinstance(m, LatentMoE)]
    loss.backward()
    after = [m.last_scores for m in model.modules() if isinstance(m, LatentMoE)]
    assert all(torch.equal(a, b) for a, b in zip(after, scores))  # a recomputation leaves the recorded scores
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seed,B,T,packed,padded", [(0, 2, 12, False, False), (1, 1, 17, True, False),
                                                    (2, 3, 9, False, True)])
def test_checkpointing_gives_the_same_loss_and_gradients(seed, B, T, packed, padded):
    model = make_model(seed).train()
    ids = tokens(seed, (B, T), model.config.vocab_size)
    kw = {}
    if packed:
        kw["doc_ids"] = (torch.arange(T) >= T // 3).long().expand(B, T) + (torch.arange(T) >= 2 * T // 3).long()
    if padded:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, -3:] = False
        kw["mask"] = mask
    loss, grads = loss_and_grads(model, ids, False, **kw)
    loss_ckpt, grads_ckpt = loss_and_grads(model, ids, True, **kw)
    assert torch.equal(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys() and len(grads) == len(list(model.parameters())) - 2
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], **TOL, msg=name)


def test_checkpointing_is_off_for_inference_and_caches():
    model = make_model(3)
    model.model.gradient_checkpointing = True
    ids = tokens(3, (2, 10), model.config.vocab_size)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        model(ids[:, :6], cache=cache)
        tail = model(ids[:, 6:], cache=cache).logits
    torch.testing.assert_close(tail, full[:, 6:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("observe_before_backward", [False, True])
def test_checkpointing_leaves_the_balancer_statistics_unchanged(observe_before_backward):
    """Two micro-batches a step, two steps; Quantile Balancing sees each batch once with or without recomputation,
    whether `observe` runs after backward (the trainer) or between forward and backward (then a second `observe`
    after backward must find nothing new)."""
    results = []
    for checkpointing in (False, True):
        model = make_model(4).train()
        model.model.gradient_checkpointing = checkpointing
        balancer = ExpertBalancer(model, mode="quantile")
        metrics = []
        for step in range(2):
            for micro in range(2):
                ids = tokens(10 * step + micro, (2, 11), model.config.vocab_size)
                loss = model(ids, labels=ids).loss
                if observe_before_backward:
                    balancer.observe()
                loss.backward()
                balancer.observe()
            metrics.append(balancer.step())
        biases = [m.gate.e_score_correction_bias.clone() for m in balancer.layers]
        results.append((metrics, biases))
    (metrics, biases), (metrics_ckpt, biases_ckpt) = results
    assert metrics_ckpt == metrics
    assert all(torch.equal(a, b) for a, b in zip(biases_ckpt, biases))
    assert any(b.abs().max() > 0 for b in biases)  # the balancer did move the biases


def tiny_narrow_vocab(dtype=torch.float64) -> K3ForCausalLM:
    """tiny with a 512-token vocabulary, so that the decoder layers (not the logits) hold most activations."""
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=512)).to(dtype).train()


def test_checkpointing_keeps_far_fewer_saved_bytes():
    model = tiny_narrow_vocab()
    ids = tokens(0, (2, 64), 512)
    saved = {}
    for checkpointing in (False, True):
        model.model.gradient_checkpointing = checkpointing
        saved[checkpointing] = activation_memory.measure(model, ids, gpu_paths=False)
    full, kept = sum(saved[False].values()), sum(saved[True].values())
    assert full / kept > 10, (full, kept)  # measured 31x
    layers = ("KDA (projections, convs, gates, o_norm)", "MLA", "MoE routed (router, latent, experts)", "AttnRes mixes")
    assert all(saved[False][c] > 0 for c in layers) and saved[False]["checkpointed layer inputs"] == 0
    # with recomputation a layer keeps only its inputs: 6 layers' partial sums p, [2, 64, 128] float64 each
    assert all(saved[True][c] == 0 for c in layers if c != "AttnRes mixes")
    assert saved[True]["checkpointed layer inputs"] == model.config.num_hidden_layers * 2 * 64 * 128 * 8


def test_measured_bytes_per_token_do_not_depend_on_length():
    """benchmarks/activation_memory.py scales a short measurement to 8 x 4096 tokens; that needs no [T, T] saves."""
    model = tiny_narrow_vocab(torch.float32)
    per_token = []
    for B, T in ((1, 64), (2, 64), (1, 192)):
        per_token.append(sum(activation_memory.measure(model, tokens(T, (B, T), 512)).values()) / (B * T))
    assert max(per_token) / min(per_token) < 1.02, per_token
