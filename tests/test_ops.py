"""Numerical ops against independent references: SiTU-GLU, RMSNorm, short causal conv, causal attention,
and the two routed-expert GEMM paths."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3.ops.attention import causal_attention
from k3.ops.conv import short_conv
from k3.ops import grouped_mm
from k3.ops.grouped_mm import expert_situ_mlp, expert_situ_mlp_grouped, expert_situ_mlp_loop
from k3.ops.norm import rms_norm
from k3.ops.situ import situ_glu



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- SiTU-GLU ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_situ_is_bounded_by_100_and_finite_for_huge_inputs(dtype):
    big = torch.tensor([1e6, -1e6, 1e30, -1e30, 3e4, -3e4, float("inf"), float("-inf")])
    g, u = torch.meshgrid(big, big, indexing="ij")
    h = situ_glu(g.to(dtype), u.to(dtype)).double()
    assert torch.isfinite(h).all()
    assert h.abs().max() <= 100.0
    # the bound is reached: large positive gate and up saturate both tanh's and the sigmoid
    assert h.max() == pytest.approx(100.0, rel=1e-2)


def test_situ_random_inputs_stay_in_bound():
    x = torch.randn(2, 4096, generator=gen(1), dtype=torch.float64) * 1e3
    assert situ_glu(x[0], x[1]).abs().max() <= 100.0


def test_situ_equals_swiglu_to_first_order_near_zero():
    # β tanh(x/β) = x − x³/(3β²) + …, so with g, u = O(s):  h = silu(g)·u·(1 + O(s²)).
    # silu(g)·u is O(s²), hence the absolute gap is O(s⁴) and the ratio h / SwiGLU is 1 + O(s²).
    g0 = torch.randn(512, generator=gen(2), dtype=torch.float64)
    u0 = torch.randn(512, generator=gen(3), dtype=torch.float64)
    abs_err, rel_err = [], []
    for s in (1e-1, 5e-2, 2.5e-2, 1.25e-2):
        g, u = s * g0, s * u0
        swiglu = F.silu(g) * u
        h = situ_glu(g, u)
        abs_err.append((h - swiglu).abs().max().item())
        rel_err.append((h / swiglu - 1).abs().max().item())
    assert rel_err[-1] < 1e-3  # the ratio goes to 1
    for a, b in zip(abs_err, abs_err[1:]):
        assert 13 < a / b < 19  # halving the scale divides the gap by ~16
    for a, b in zip(rel_err, rel_err[1:]):
        assert 3.3 < a / b < 4.7  # ... and the relative gap by ~4


def _situ_scalar(g: float, u: float, b1: float, b2: float) -> float:
    sig = 1.0 / (1.0 + math.exp(-g)) if g >= 0 else math.exp(g) / (1.0 + math.exp(g))
    return b1 * math.tanh(g / b1) * sig * b2 * math.tanh(u / b2)


@pytest.mark.parametrize("seed,betas", [(4, (4.0, 25.0)), (5, (2.0, 7.0))])
def test_situ_matches_scalar_float64_formula(seed, betas):
    g = torch.randn(300, generator=gen(seed), dtype=torch.float64) * 8
    u = torch.randn(300, generator=gen(seed + 100), dtype=torch.float64) * 40
    ref = torch.tensor([_situ_scalar(a, b, *betas) for a, b in zip(g.tolist(), u.tolist())], dtype=torch.float64)
    torch.testing.assert_close(situ_glu(g, u, *betas), ref, rtol=1e-12, atol=1e-12)
    # float32 input: computed in float32, returned as float32
    h32 = situ_glu(g.float(), u.float(), *betas)
    assert h32.dtype == torch.float32
    torch.testing.assert_close(h32.double(), ref, rtol=1e-5, atol=1e-5)


def test_situ_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        situ_glu(torch.zeros(3), torch.zeros(4))


# ---- RMSNorm -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,eps", [(6, 1e-5), (7, 1e-2)])
def test_rms_norm_matches_direct_formula(seed, eps):
    x = torch.randn(3, 5, 64, generator=gen(seed), dtype=torch.float64) * 3
    w = torch.randn(64, generator=gen(seed + 1), dtype=torch.float64)
    ref = torch.empty_like(x)
    for idx in torch.cartesian_prod(torch.arange(3), torch.arange(5)).tolist():
        v = x[idx[0], idx[1]]
        ref[idx[0], idx[1]] = w * v / math.sqrt(float((v * v).sum()) / 64 + eps)
    torch.testing.assert_close(rms_norm(x, w, eps), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rms_norm(x, None, eps), ref / w, rtol=1e-10, atol=1e-10)


def test_rms_norm_bf16_input_is_computed_in_float32():
    x = torch.randn(4, 256, generator=gen(8)) * 10
    w = torch.rand(256, generator=gen(9)) + 0.5
    xb = x.bfloat16()
    y = rms_norm(xb, w, 1e-5)
    assert y.dtype == torch.bfloat16
    ref = rms_norm(xb.float(), w, 1e-5).bfloat16()  # fp32 compute, one rounding at the end
    assert torch.equal(y, ref)


# ---- short causal conv -----------------------------------------------------------------------------------------
def conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise conv over the input padded on the left with W−1 zeros. x: [B, T, C]."""
    W = weight.shape[-1]
    return F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=x.shape[-1]).transpose(1, 2)


@pytest.mark.parametrize("seed,W,T", [(10, 4, 9), (11, 4, 1), (12, 2, 7), (13, 1, 5), (14, 5, 3)])
def test_short_conv_matches_conv1d(seed, W, T):
    g = gen(seed)
    x = torch.randn(2, T, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 1, W, generator=g, dtype=torch.float64)
    y, tail = short_conv(x, w)
    torch.testing.assert_close(y, conv_reference(x, w), rtol=1e-12, atol=1e-12)
    assert tail.shape == (2, W - 1, 6)


@pytest.mark.parametrize("seed,split", [(15, 1), (16, 2), (17, 5), (18, 9)])
def test_short_conv_carried_tail_equals_one_pass(seed, split):
    g = gen(seed)
    x = torch.randn(2, 10, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 1, 4, generator=g, dtype=torch.float64)
    whole, whole_tail = short_conv(x, w)
    ya, tail = short_conv(x[:, :split], w)
    yb, tail_b = short_conv(x[:, split:], w, tail)
    torch.testing.assert_close(torch.cat([ya, yb], 1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tail_b, whole_tail, rtol=0, atol=0)


def test_short_conv_token_by_token_equals_one_pass():
    g = gen(19)
    x = torch.randn(1, 7, 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, 1, 4, generator=g, dtype=torch.float64)
    tail, ys = None, []
    for t in range(7):
        y, tail = short_conv(x[:, t:t + 1], w, tail)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), conv_reference(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed,lengths", [(20, [4, 6]), (21, [1, 2, 7]), (22, [10])])
def test_short_conv_doc_ids_equal_separate_documents(seed, lengths):
    g = gen(seed)
    T = sum(lengths)
    x = torch.randn(2, T, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 1, 4, generator=g, dtype=torch.float64)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, T)
    y, _ = short_conv(x, w, doc_ids=doc)
    parts, start = [], 0
    for n in lengths:
        parts.append(conv_reference(x[:, start:start + n], w))
        start += n
    torch.testing.assert_close(y, torch.cat(parts, 1), rtol=1e-12, atol=1e-12)


def test_short_conv_float32_weights_with_bf16_input():
    x = torch.randn(1, 6, 8, generator=gen(23)).bfloat16()
    w = torch.randn(8, 1, 4, generator=gen(24))
    y, tail = short_conv(x, w)
    assert y.dtype == torch.bfloat16 and tail.dtype == torch.float32
    torch.testing.assert_close(y.float(), conv_reference(x.float(), w), rtol=1e-2, atol=1e-2)


# ---- causal attention ------------------------------------------------------------------------------------------
def attention_reference(q, k, v, scale):
    """Explicit causal softmax attention, per head. q, k: [B, T, H, D], v: [B, T, H, V]."""
    T = q.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshv->bthv", torch.softmax(s, -1), v)


@pytest.mark.parametrize("seed,T,D,V", [(30, 1, 8, 8), (31, 7, 12, 6), (32, 16, 24, 16)])
def test_causal_attention_matches_softmax_reference(seed, T, D, V):
    g = gen(seed)
    q = torch.randn(2, T, 3, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, T, 3, D, generator=g, dtype=torch.float64)
    v = torch.randn(2, T, 3, V, generator=g, dtype=torch.float64)
    scale = D ** -0.5
    torch.testing.assert_close(causal_attention(q, k, v, scale), attention_reference(q, k, v, scale),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed,lengths", [(33, [3, 5]), (34, [1, 4, 2])])
def test_causal_attention_doc_ids_equal_separate_runs(seed, lengths):
    g = gen(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(2, T, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, T)
    out = causal_attention(q, k, v, 0.3, doc_ids=doc)
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        parts.append(attention_reference(q[:, sl], k[:, sl], v[:, sl], 0.3))
        start += n
    torch.testing.assert_close(out, torch.cat(parts, 1), rtol=1e-12, atol=1e-12)


# ---- routed-expert GEMMs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,counts,D,I", [
    (40, [3, 0, 7, 0, 2], 16, 24),
    (41, [0, 0, 5], 8, 8),
    (42, [1, 1, 1, 1, 1, 1, 1, 1], 32, 16),
    (43, [20, 0], 12, 4),
])
def test_grouped_expert_mlp_matches_loop(seed, counts, D, I, monkeypatch):
    g = gen(seed)
    E, S = len(counts), sum(counts)
    x = torch.randn(S, D, generator=g, requires_grad=True)
    w1 = (torch.randn(E, I, D, generator=g) * 0.3).requires_grad_()
    w3 = (torch.randn(E, I, D, generator=g) * 0.3).requires_grad_()
    w2 = (torch.randn(E, D, I, generator=g) * 0.3).requires_grad_()
    ref = expert_situ_mlp_loop(x, counts, w1, w3, w2)
    out = expert_situ_mlp_grouped(x, torch.tensor(counts), w1, w3, w2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the graph-capturable path (weights gathered per row, taken while a capture forbids host reads), float64
    with monkeypatch.context() as m:
        m.setattr(grouped_mm, "host_offsets_forbidden", lambda *a: True)
        rows = expert_situ_mlp(x.double(), torch.tensor(counts), w1.double(), w3.double(), w2.double())
    torch.testing.assert_close(rows, ref.double(), rtol=1e-5, atol=1e-5)
    # the loop itself against a per-row formula, so that both paths are pinned to the definition
    e_of_row = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    for r in range(S):
        e = int(e_of_row[r])
        h = situ_glu(w1[e] @ x[r], w3[e] @ x[r])
        torch.testing.assert_close(ref[r], w2[e] @ h, rtol=1e-5, atol=1e-5)
    # gradients: _grouped_mm's backward wants a dense upstream gradient
    up = torch.randn(out.shape, generator=g)
    g_ref = torch.autograd.grad(ref, (x, w1, w3, w2), up)
    g_out = torch.autograd.grad(out, (x, w1, w3, w2), up)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # experts without tokens get exactly zero gradient
    for e, n in enumerate(counts):
        if n == 0:
            assert g_out[1][e].abs().max() == 0 and g_out[3][e].abs().max() == 0


@pytest.mark.parametrize("seed, counts", [(50, [4, 0, 6, 2]), (51, [0, 9])])
def test_training_joins_gate_and_up_into_one_gemm_and_inference_keeps_them_apart(seed, counts, monkeypatch):
    """With a gradient recorded, the grouped path runs gate and up as one GEMM over `joined_gate_up` (2 grouped
    GEMMs forward: ∂L/∂x then comes back from one); without, three GEMMs on the weights as they lie (no joined
    copy made). Both equal the loop (bf16 activations over fp32 master weights, as autocast leaves them: the
    weights cast in the join), and the fp32 weights' gradients come back fp32, equal to the loop's."""
    g = gen(seed)
    E, S, L, I = len(counts), sum(counts), 16, 8
    x = torch.randn(S, L, generator=g).bfloat16().requires_grad_()
    w1, w3 = ((torch.randn(E, I, L, generator=g) * 0.3).requires_grad_() for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=g) * 0.3).requires_grad_()
    ref = expert_situ_mlp_loop(x.detach().double(), counts, *(w.detach().bfloat16().double() for w in (w1, w3, w2)))
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, **kw: calls.append(tuple(b.shape)) or real(a, b, **kw))
    out = expert_situ_mlp(x, torch.tensor(counts), w1, w3, w2)
    assert calls == [(E, L, 2 * I), (E, I, L)] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    up = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (x, w1, w3, w2), up)
    xs, ws = x.detach().double().requires_grad_(), [w.detach().double().requires_grad_() for w in (w1, w3, w2)]
    want = torch.autograd.grad(expert_situ_mlp_loop(xs, counts, *ws), (xs, *ws), up.double())
    for got, w in zip(grads, want):
        assert got.dtype == (torch.bfloat16 if got.shape == x.shape else torch.float32)
        torch.testing.assert_close(got.double(), w, rtol=5e-2, atol=5e-2)
    # bf16 weights (no cast): each weight's gradient is a GEMM's own contiguous output, which AccumulateGrad takes
    # as it is (halves of one joined product would each be copied)
    wb = [w.detach().bfloat16().requires_grad_() for w in (w1, w3)]
    for got, w in zip(torch.autograd.grad(expert_situ_mlp(x, torch.tensor(counts), *wb, w2), wb, up), want[1:]):
        assert got.is_contiguous() and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), w, rtol=5e-2, atol=5e-2)
    calls.clear()
    with torch.no_grad():
        out_inf = expert_situ_mlp(x, torch.tensor(counts), w1, w3, w2)
    assert calls == [(E, L, I)] * 2 + [(E, I, L)]
    torch.testing.assert_close(out_inf, out.detach(), rtol=1e-2, atol=1e-2)


def test_graph_capture_paths_match_the_loop(monkeypatch):
    """While a CUDA graph captures outside aligned bf16 (host_offsets_forbidden), the experts and the QAT
    experts take the per-row gathered-weight path: same result as the loop. The capture is emulated on CPU by
    forcing the predicate; a plain model can be captured, one with packed MXFP4 experts only through k3's MXFP4
    kernels."""
    from k3 import K3Config, K3ForCausalLM
    from k3.model.cuda_graph import graph_blocker, wants_graphs
    from k3.ops import mx_experts

    g = gen(21)
    counts = [3, 0, 5, 1]
    E, S, D, I = len(counts), sum(counts), 32, 16
    x = torch.randn(S, D, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(E, I, D, generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    w2 = torch.randn(E, D, I, generator=g, dtype=torch.float64) * 0.3
    ref = expert_situ_mlp_loop(x, counts, w1, w3, w2)
    calls = []
    real_rows = grouped_mm.rows_linear
    monkeypatch.setattr(grouped_mm, "host_offsets_forbidden", lambda *a: True)
    monkeypatch.setattr(grouped_mm, "rows_linear", lambda *a: calls.append(1) or real_rows(*a))
    torch.testing.assert_close(grouped_mm.expert_situ_mlp(x, torch.tensor(counts), w1, w3, w2), ref)
    assert len(calls) == 3
    loop = torch.cat([x[a:b] @ w1[e].t() for e, (a, b) in enumerate(zip([0, 3, 3, 8], [3, 3, 8, 9]))])
    torch.testing.assert_close(mx_experts.grouped_linear(x, torch.tensor(counts), w1), loop)
    assert len(calls) == 4
    model = K3ForCausalLM(K3Config.preset("tiny"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_blocker(model) is None
    assert wants_graphs(model, cuda, None) and not wants_graphs(model, cpu, None) and wants_graphs(model, cpu, True)
    for m in model.modules():
        if hasattr(m, "packed") and hasattr(m, "w1"):
            mx_experts.pack_experts_(m)
    # packed experts are capturable through k3's Triton MXFP4 kernels only (on the CPU CI: no triton; on a card:
    # both ways, by switching them off)
    from k3.model import cuda_graph

    monkeypatch.setattr(cuda_graph, "packed_kernels_enabled", lambda: False)
    assert "packed MXFP4" in graph_blocker(model)
    assert not wants_graphs(model, cuda, None)  # the engine's and generate's default: eager decode
    with pytest.raises(ValueError, match="packed MXFP4"):
        wants_graphs(model, cuda, True)
    monkeypatch.setattr(cuda_graph, "packed_kernels_enabled", lambda: True)
    assert graph_blocker(model) is None and wants_graphs(model, cuda, None)


def test_qat_experts_take_bf16_activations_with_fp32_weights():
    """Under bf16 autocast the QAT experts meet bf16 activations and fp32 (fake-quantized) master weights, which
    `_grouped_mm` does not cast by itself: the result is the fp32 one to bf16 accuracy, gradients reach the
    fp32 weights."""
    from k3.ops.mx_experts import qat_expert_situ_mlp

    g = gen(31)
    counts = torch.tensor([5, 0, 11, 3])
    E, S, L, I = 4, 19, 64, 32
    x = torch.randn(S, L, generator=g)
    w1, w3 = ((torch.randn(E, I, L, generator=g) * 0.2).requires_grad_() for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=g) * 0.2).requires_grad_()
    x = x.bfloat16()
    ref = qat_expert_situ_mlp(x.float(), counts, w1, w3, w2)
    out = qat_expert_situ_mlp(x, counts, w1, w3, w2)
    assert out.dtype == torch.bfloat16
    # bf16 GEMMs, and the MXFP8 codes of the hidden activations that this rounding moves across a step
    assert (out.float() - ref).norm() / ref.norm() < 3e-2
    out.float().sum().backward()
    assert w1.grad is not None and w1.grad.dtype == torch.float32 and w1.grad.abs().sum() > 0


def test_kernel_device_context_keeps_no_tensor_alive():
    """`on_device` runs around every Triton launch: it must not hold on to its tensor (a cache keyed by the
    tensor would keep every activation of every step alive)."""
    import gc
    import weakref

    from k3.ops.triton_dispatch import on_device

    t = torch.randn(4)
    ref = weakref.ref(t)
    with on_device(t):
        pass
    del t
    gc.collect()
    assert ref() is None


# ---- MoE row permutations ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,N,k,L", [(0, 1, 1, 3), (1, 7, 2, 5), (2, 33, 4, 16), (3, 64, 8, 8)])
def test_token_permutations_equal_indexing(seed, N, k, L):
    """dispatch_rows / permute_rows (gather backwards) equal plain indexing differentiated by autograd."""
    from k3.ops.token_permute import dispatch_rows, inverse_permutation, permute_rows
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, 5, (N * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    slot = inverse_permutation(order)
    assert torch.equal(order[slot], torch.arange(N * k)) and torch.equal(slot[order], torch.arange(N * k))
    z = torch.randn(N, L, generator=g, dtype=torch.float64)
    scale = torch.randn(N * k, 1, generator=g, dtype=torch.float64)  # makes each of a token's copies count differently
    dy = torch.randn(N * k, L, generator=g, dtype=torch.float64)
    res = []
    for fwd in (lambda z: (z[order // k] * scale)[slot], lambda z: permute_rows(dispatch_rows(z, order, slot, k) * scale, slot, order)):
        zz = z.clone().requires_grad_()
        y = fwd(zz)
        y.backward(dy)
        res.append((y.detach(), zz.grad))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=0, atol=0)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-12, atol=1e-12)


def test_fp32_takes_fla_only_where_tf32_is_allowed():
    """fla's CUDA kernels compute fp32 dots in TF32: fp32 tensors go there only after the user allowed TF32 for
    fp32 matmuls, through either of torch's APIs; bf16 needs no permission."""
    from k3.ops.kda_fla import fp32_allowed

    matmul = torch.backends.cuda.matmul
    assert matmul.fp32_precision == "none" and not fp32_allowed()  # torch's default: IEEE fp32
    try:
        matmul.fp32_precision = "tf32"
        assert fp32_allowed()
        matmul.fp32_precision = "ieee"
        assert not fp32_allowed()
        matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision("high")  # the legacy API
        assert fp32_allowed()
    finally:  # both APIs back to their defaults, so that no later test sees a mix
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = "none"
    assert not fp32_allowed() and torch.get_float32_matmul_precision() == "highest"


def test_safe_gate_bound_decides_the_fla_kernels():
    """fla's safe-gate kernels take gates bounded in [-5, 0) only; without a known bound, never."""
    from k3.ops.kda_fla import safe_gate_ok

    assert safe_gate_ok(-5.0) and safe_gate_ok(-1.0)
    assert not safe_gate_ok(-5.01) and not safe_gate_ok(-8) and not safe_gate_ok(None) and not safe_gate_ok(0.0)
