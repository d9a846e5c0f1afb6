"""Packed causal attention of several segments (k3.ops.varlen_attention) against a float64 per-segment softmax, and
the serving MLA layout's prefill rows through it: one gather, one kv_b_proj and one attention a layer."""
import math

import pytest
import torch

from k3.ops import varlen_attention as va
from k3.ops.varlen_attention import VarlenSegments, varlen_causal_attention

# (new tokens, whole context) per segment: a fresh prompt (T == L), chunks after a prefix, a one-token segment
SEGMENTS = [(5, 5), (3, 11), (1, 4), (7, 9)]


def cumulative(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def reference(q, k, v, segs, scale):
    """Each segment on its own in float64: query t of T sits at key position L − T + t and sees keys 0 … that."""
    out, qa, ka = [], 0, 0
    for T, L in segs:
        qs, ks, vs = (x.double() for x in (q[qa:qa + T], k[ka:ka + L], v[ka:ka + L]))
        scores = torch.einsum("thd,shd->hts", qs, ks) * scale
        allowed = torch.arange(L)[None, :] <= (L - T + torch.arange(T))[:, None]
        p = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
        out.append(torch.einsum("hts,shv->thv", p, vs))
        qa, ka = qa + T, ka + L
    return torch.cat(out)


def inputs(segs, H=3, D=12, V=8, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    Nq, Nk = sum(T for T, _ in segs), sum(L for _, L in segs)
    q, k = torch.randn(Nq, H, D, generator=g), torch.randn(Nk, H, D, generator=g)
    v = torch.randn(Nk, H, V, generator=g)
    seg = VarlenSegments.build(cumulative([T for T, _ in segs]), cumulative([L for _, L in segs]), device)
    return [t.to(device, dtype) for t in (q, k, v)], seg


@pytest.mark.parametrize("backend", ["masked", "loop"])
def test_backends_equal_a_float64_softmax_per_segment(backend):
    (q, k, v), seg = inputs(SEGMENTS)
    o = varlen_causal_attention(q, k, v, seg, 0.3, backend=backend)
    assert o.shape == (q.shape[0], q.shape[1], v.shape[-1])
    torch.testing.assert_close(o.double(), reference(q, k, v, SEGMENTS, 0.3), rtol=1e-5, atol=1e-5)


def test_the_mask_keeps_segments_apart_and_causal():
    _, seg = inputs([(2, 3), (1, 2)])
    expected = torch.tensor([[1, 1, 0, 0, 0],   # segment 0, query at position 1 of 3 keys
                             [1, 1, 1, 0, 0],   # position 2
                             [0, 0, 0, 1, 1]],  # segment 1, position 1 of 2
                            dtype=torch.bool)
    assert torch.equal(seg.mask, expected)


def test_large_calls_fall_back_to_one_sdpa_a_segment(monkeypatch):
    (q, k, v), seg = inputs(SEGMENTS)
    calls, real = [], va.causal_attention
    monkeypatch.setattr(va, "causal_attention", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(va, "MASKED_SDPA_MAX_SCORES", 10)
    o = varlen_causal_attention(q, k, v, seg, 0.3)
    assert len(calls) == len(SEGMENTS)
    torch.testing.assert_close(o.double(), reference(q, k, v, SEGMENTS, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cu_q, cu_k", [([0, 3], [0, 2]),          # more queries than keys
                                        ([0, 0, 2], [0, 1, 3]),    # an empty segment
                                        ([0, 2], [0, 2, 4]),       # offsets of different counts
                                        ([0], [0])])
def test_bad_segments_are_refused(cu_q, cu_k):
    with pytest.raises(ValueError, match="offsets|segment"):
        VarlenSegments.build(cu_q, cu_k, "cpu")


def test_unknown_backend_is_refused():
    (q, k, v), seg = inputs(SEGMENTS)
    with pytest.raises(ValueError, match="backend"):
        varlen_causal_attention(q, k, v, seg, 0.3, backend="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention's varlen kernel)")
@pytest.mark.parametrize("D, V", [(192, 128), (64, 64)])  # MLA's qk/v split, and equal head dims
def test_cuda_flash_varlen_equals_the_reference(D, V):
    (q, k, v), seg = inputs(SEGMENTS, H=4, D=D, V=V, dtype=torch.bfloat16, device="cuda")
    assert va.flash_usable(q, k, v)
    o = varlen_causal_attention(q, k, v, seg, D ** -0.5)
    ref = reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), SEGMENTS, D ** -0.5)
    torch.testing.assert_close(o.double().cpu(), ref, rtol=2e-2, atol=2e-2)
    masked = varlen_causal_attention(q, k, v, seg, D ** -0.5, backend="masked")
    torch.testing.assert_close(o.float(), masked.float(), rtol=2e-2, atol=2e-2)
