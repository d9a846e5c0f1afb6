"""KDA's q/k L2 norms taken by the short convs where a gradient is recorded (k3.model.kda.DenseLayout,
K3_NO_QK_NORM_FOLD), against the norms in the core: the tiny model's loss and every gradient, in rows and packed
documents, on the torch path (float64: the same ops, so equal) and through the conv kernels (the Triton interpreter
on CPU, fp32); which path runs when; on CUDA, through fla in bf16 against the model in fp32."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import

from k3 import K3ForCausalLM, envs  # noqa: E402
from k3.model import kda as kda_module  # noqa: E402
from k3.ops import conv as conv_module  # noqa: E402
from k3.ops import kda_core as core_module  # noqa: E402
from random_model import random_tiny_model as tiny_model  # noqa: E402


def loss_and_grads(model, ids, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, doc_ids=doc_ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def folded_and_not(model, ids, doc_ids=None):
    got = loss_and_grads(model, ids, doc_ids)
    with envs.override(no_qk_norm_fold=True):
        want = loss_and_grads(model, ids, doc_ids)
    return got, want


def docs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (B, T), generator=g).sort(-1).values


def record_norms(monkeypatch):
    """Where each L2 norm runs: ("conv", K) for a conv's heads, "core" for the core's pair."""
    seen = []
    real_conv = conv_module.short_conv
    monkeypatch.setattr(kda_module, "short_conv",
                        lambda *a: (a[5] is not None and seen.append(("conv", a[5]))) or real_conv(*a))
    real_l2 = core_module.l2_norm
    monkeypatch.setattr(core_module, "l2_norm", lambda x: seen.append("core") or real_l2(x))
    return seen


@pytest.mark.parametrize("packed", [False, True])
def test_torch_path_equals_the_core_norms_and_takes_the_fold(monkeypatch, packed):
    model = tiny_model(3, torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    doc_ids = docs(2, 24, 5) if packed else None
    seen = record_norms(monkeypatch)
    got = loss_and_grads(model, ids, doc_ids)
    n_kda = sum(not layer.is_mla for layer in model.model.layers)
    K = model.config.linear_attn_config.head_dim
    assert seen == [("conv", K), ("conv", K)] * n_kda  # q and k in their convs, none in the core
    seen.clear()
    with envs.override(no_qk_norm_fold=True):
        want = loss_and_grads(model, ids, doc_ids)
    assert seen == ["core", "core"] * n_kda
    assert len(got) == len(want) > 50
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda m: f"tensor {i}: {m}")


def test_inference_keeps_the_core_norms(monkeypatch):
    """Without a gradient (generation, serving's dense rows) the convs leave q and k as they were."""
    model = tiny_model(6, torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(7))
    seen = record_norms(monkeypatch)
    with torch.no_grad():
        model(ids)
    assert seen and set(seen) == {"core"}


def test_switch_parses():
    assert [envs.parse(env).no_qk_norm_fold for env in ({}, {"K3_NO_QK_NORM_FOLD": "0"},
                                                       {"K3_NO_QK_NORM_FOLD": "1"})] == [False, False, True]


@pytest.mark.parametrize("packed", [False, True])
def test_through_the_conv_kernels(monkeypatch, packed):
    """The tiny model (fp32) with its convs on the Triton kernels (forced on for CPU tensors under the
    interpreter; everything else as on CPU): the folded kernels' loss and gradients equal the unfolded kernels
    followed by the core's norms."""
    pytest.importorskip("triton")
    real_use = conv_module.use_triton
    monkeypatch.setattr(conv_module, "use_triton", lambda x, name: name == "_conv_triton" or real_use(x, name))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (on CUDA the kernels run natively)
    model = tiny_model(8, torch.float32, device)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(9)).to(device)
    doc_ids = docs(2, 20, 10).to(device) if packed else None
    got, want = folded_and_not(model, ids, doc_ids)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fold_is_as_close_to_fp32_as_the_core_norms():
    """On CUDA in bf16 (fla's chunked KDA with and without its in-kernel norms, the conv kernels with and
    without theirs), packed documents: the folded run's loss and KDA gradients are no further from the same
    model's fp32 run (references, no fla) than the unfolded run's, within a factor for rounding."""
    from k3.ops.kda_fla import fla_available

    if not fla_available() and not envs.current().require_fla:
        pytest.skip("needs fla")
    model = tiny_model(11, torch.float32, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 130), device="cuda")
    doc_ids = docs(2, 130, 12).cuda()
    with envs.override(no_fla=True, no_triton=envs.ALL):
        truth = loss_and_grads(model, ids, doc_ids)
    bf16 = K3ForCausalLM(model.config).cuda().bfloat16()
    bf16.load_state_dict(model.state_dict())
    got, want = folded_and_not(bf16.train(), ids, doc_ids)
    names = [None] + [n for n, _ in model.named_parameters()]
    checked = 0
    for name, a, b, t in zip(names, got, want, truth):
        if t is None or (name is not None and "self_attn" not in name):
            continue
        err = lambda v: float((v.double() - t.double()).norm() / t.double().norm().clamp_min(1e-30))  # noqa: E731
        assert err(a) < 1.5 * err(b) + 2e-3, (name, err(a), err(b))
        checked += 1
    assert checked > 20
