"""Packed documents as varlen segments (k3.ops.varlen_attention.packed_documents, document_attention): the
segments of whole rows and of a context-parallel shard's queries, and attention through them against the masked
SDPA over [B, T, S] (k3.ops.attention.causal_attention's doc_ids path, and a mask built here for shards), forward
and backward in float64; on CUDA, FlashAttention's varlen kernel against the masked SDPA, and MLA's training
attention taking it."""
import math

import pytest
import torch

from k3.ops import varlen_attention as va
from k3.ops.attention import causal_attention
from k3.ops.varlen_attention import document_attention, packed_documents


def doc_rows(g: torch.Generator, B: int, S: int, mean_len: float) -> torch.Tensor:
    """[B, S] ids as k3.data.packing makes them: each row's documents numbered from 0, of random lengths."""
    rows = []
    for _ in range(B):
        ids, doc = [], 0
        while len(ids) < S:
            n = 1 + int(torch.empty(1).exponential_(1 / mean_len, generator=g).item())
            ids += [doc] * n
            doc += 1
        rows.append(ids[:S])
    return torch.tensor(rows)


def masked_reference(q, k, v, scale, doc_ids, q_start=0):
    """Queries at positions q_start … q_start+T−1 of rows of S keys: key j seen by query i iff j ≤ i and one
    document; SDPA with the [B, T, S] mask (the path packing replaces)."""
    T, S = q.shape[1], k.shape[1]
    pos = torch.arange(q_start, q_start + T)
    mask = (torch.arange(S)[None, :] <= pos[:, None])[None] & (doc_ids[:, q_start:q_start + T, None]
                                                                 == doc_ids[:, None, :])
    o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                         attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2)


def test_the_segments_of_rows_and_of_a_shard():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2],
                        [0, 0, 0, 0, 0, 0, 0, 0],
                        [0, 1, 2, 3, 4, 5, 6, 7]])
    whole = packed_documents(ids, "cpu")
    # row 0: documents of 3, 2, 3; row 1: one of 8; row 2: eight of 1 (queries and keys alike)
    assert whole.segments.cu_q_host == whole.segments.cu_k_host == [0, 3, 5, 8, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    assert whole.key_spans == ((0, 8), (0, 8), (0, 8))
    # a shard of positions 4..5: row 0's queries are document 1's last and document 2's first; its keys start at
    # document 1 (position 3); row 1's keys are 0..5; row 2's queries are each their own document
    shard = packed_documents(ids, "cpu", q_start=4, queries=2)
    assert shard.key_spans == ((3, 6), (0, 6), (4, 6))
    assert shard.segments.cu_q_host == [0, 1, 2, 4, 5, 6]
    assert shard.segments.cu_k_host == [0, 2, 3, 9, 10, 11]


def test_whole_rows_are_rows_of_one_document():
    one = torch.tensor([[5] * 8, [0] * 8])
    assert packed_documents(one, "cpu").whole_rows
    assert packed_documents(one, "cpu", q_start=4, queries=2).whole_rows  # a shard's keys still start at 0
    two = torch.tensor([[0] * 8, [0] * 7 + [1]])
    assert not packed_documents(two, "cpu").whole_rows
    # the shard's queries lie in one document, which starts after key 0: not whole rows either
    assert not packed_documents(torch.tensor([[0, 0, 1, 1, 1, 1]]), "cpu", q_start=3, queries=2).whole_rows


def test_mla_takes_the_causal_kernel_for_rows_of_one_document(monkeypatch):
    """Where MLA packs documents (forced here: the varlen kernel is CUDA's), rows that are each one document go
    to the plain causal attention, not through the packing; rows of several documents keep the packing. Both
    equal the masked SDPA over the doc ids (float64)."""
    import k3.model.mla as mla
    from k3 import K3Config
    torch.manual_seed(3)
    m = mla.MultiHeadLatentAttention(K3Config.preset("tiny"), 0).double()
    calls = []
    monkeypatch.setattr(mla, "packs_documents", lambda *a: True)
    monkeypatch.setattr(mla, "document_attention", lambda *a, **kw: calls.append(1) or document_attention(*a, **kw))
    x = torch.randn(2, 12, m.q_a_proj.in_features, dtype=torch.float64)
    for ids, packed in ((torch.tensor([[4] * 12, [0] * 12]), False),
                        (torch.tensor([[0] * 5 + [1] * 7, [0] * 12]), True)):
        calls.clear()
        out = m(x, doc_ids=ids)
        assert bool(calls) == packed
        with monkeypatch.context() as plain:
            plain.setattr(mla, "packs_documents", lambda *a: False)  # the masked SDPA over the ids
            torch.testing.assert_close(out, m(x, doc_ids=ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed, B, S, mean_len", [(0, 2, 17, 4.0), (1, 3, 32, 1.5), (2, 1, 24, 40.0)])
@pytest.mark.parametrize("backend", ["masked", "loop"])
def test_whole_rows_equal_the_masked_sdpa_forward_and_backward(seed, B, S, mean_len, backend):
    g = torch.Generator().manual_seed(seed)
    H, D, V = 3, 12, 8
    doc_ids = doc_rows(g, B, S, mean_len)
    q, k = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(B, S, H, V, generator=g, dtype=torch.float64, requires_grad=True)
    packing = packed_documents(doc_ids, "cpu")
    out = document_attention(q, packing.pack_keys(k), packing.pack_keys(v), 0.3, packing, backend=backend)
    ref = causal_attention(q, k, v, 0.3, doc_ids)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed, q_start, T", [(3, 0, 9), (4, 7, 9), (5, 20, 12), (6, 31, 1)])
def test_a_shards_queries_equal_the_masked_sdpa_over_the_whole_row(seed, q_start, T):
    g = torch.Generator().manual_seed(seed)
    B, S, H, D, V = 2, 32, 2, 8, 6
    doc_ids = doc_rows(g, B, S, 5.0)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, S, H, V, generator=g, dtype=torch.float64, requires_grad=True)
    packing = packed_documents(doc_ids, "cpu", q_start, T)
    # no key after the shard's last query, and none before its first query's document, is packed
    assert all(e == q_start + T and a <= q_start and (a == 0 or doc_ids[b, a - 1] != doc_ids[b, q_start])
               for b, (a, e) in enumerate(packing.key_spans))
    out = document_attention(q, packing.pack_keys(k), packing.pack_keys(v), 0.5, packing)
    ref = masked_reference(q, k, v, 0.5, doc_ids, q_start)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_forward_reads_the_ids_back_once_and_a_changed_tensor_is_packed_again():
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    first = packed_documents(ids, "cpu")
    assert packed_documents(ids, "cpu") is first  # the layers of one forward share it
    ids[0, 2:] = 0  # one document now: an in-place change must not reuse the old segments
    again = packed_documents(ids, "cpu")
    assert again is not first and again.segments.cu_q_host == [0, 5]


def test_ids_made_under_inference_mode_are_packed_each_call():
    with torch.inference_mode():  # an inference tensor keeps no version counter to key a kept packing by
        ids = torch.tensor([[0, 0, 1]])
        first = packed_documents(ids, "cpu")
        ids[0, 2] = 0
        assert packed_documents(ids, "cpu").segments.cu_q_host == [0, 3] and first.segments.cu_q_host == [0, 2, 3]


@pytest.mark.parametrize("q_start, T", [(-1, 2), (4, 2), (0, 0), (5, 1)])
def test_queries_outside_the_rows_are_refused(q_start, T):
    with pytest.raises(ValueError, match="queries"):
        packed_documents(torch.zeros(2, 5, dtype=torch.long), "cpu", q_start, T)


def test_queries_of_another_shape_than_the_packing_are_refused():
    packing = packed_documents(torch.zeros(2, 6, dtype=torch.long), "cpu")
    q = torch.randn(2, 5, 1, 4)
    kv = torch.randn(12, 1, 4)
    with pytest.raises(ValueError, match="packing"):
        document_attention(q, kv, kv, 0.5, packing)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention's varlen kernel)")


@needs_cuda
@pytest.mark.parametrize("B, S, mean_len", [(2, 1024, 100.0), (1, 4096, 700.0), (4, 256, 3.0)])
def test_cuda_flash_documents_equal_the_masked_sdpa(B, S, mean_len):
    g = torch.Generator().manual_seed(7)
    H, D, V = 4, 192, 128  # MLA's qk / v split
    doc_ids = doc_rows(g, B, S, mean_len).cuda()
    q, k = (torch.randn(B, S, H, D, generator=g).cuda().bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, S, H, V, generator=g).cuda().bfloat16().requires_grad_()
    assert va.packs_documents(q, k, v)
    packing = packed_documents(doc_ids, q.device)
    out = document_attention(q, packing.pack_keys(k), packing.pack_keys(v), D ** -0.5, packing)
    ref = causal_attention(q, k, v, D ** -0.5, doc_ids)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    w = torch.randn(ref.shape, device="cuda", dtype=torch.bfloat16)
    for got, want in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                         torch.autograd.grad((ref * w).sum(), (q, k, v))):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, err


@needs_cuda
def test_cuda_mla_training_attention_takes_the_packed_documents(monkeypatch):
    from k3 import K3Config
    from k3.model.mla import MultiHeadLatentAttention
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(K3Config.preset("tiny"), 0).cuda().bfloat16()
    doc_ids = doc_rows(torch.Generator().manual_seed(8), 2, 512, 60.0).cuda()
    x = torch.randn(2, 512, m.q_a_proj.in_features, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = va.varlen_causal_attention
    monkeypatch.setattr(va, "varlen_causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = m(x, doc_ids=doc_ids)
    assert calls, "MLA's packed documents did not take the varlen path"
    import k3.model.mla as mla
    monkeypatch.setattr(mla, "packs_documents", lambda *a: False)
    ref = m(x, doc_ids=doc_ids)
    assert math.isfinite(out.float().abs().max().item())
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
