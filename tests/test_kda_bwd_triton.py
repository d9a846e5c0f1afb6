"""KDA's chunk-backward WY/state stage: k3.ops.kda_bwd_ref against autograd of the chunk's forward relations
(float64), k3.ops._kda_bwd_triton against that reference (float64 and float32; the Triton interpreter without
CUDA), and the verifier that decides which of fla's calls k3's backend takes (k3.ops.kda_fla_backend).
The intra-chunk stage's reference and kernel likewise. On CUDA with fla (skipped elsewhere): k3's kernels against
fla's at small's training shape, and fla_kda_gated's gradients with K3_KDA_BWD=k3/wy/intra against fla's own."""
import math
import os

import pytest
import torch

from k3 import envs
from k3.ops.kda_bwd_ref import (chunk_kda_bwd_intra_ref, chunk_kda_bwd_wy_dqkg_ref, intra_inputs, stage_inputs,
                                varlen_stage_inputs)
from k3.ops.kda_fla_backend import intra_accepts, wy_dqkg_accepts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

BT = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_reference_is_the_gradient_of_the_chunk_relations():
    """Per chunk, with W = A diag(β) and A = (I + M)^-1: w = W (k ⊙ 2^g), u = W v, v_new = u - w h,
    o = scale (q ⊙ 2^g) h, h' = 2^gn ⊙ h + (k ⊙ 2^(gn-g))^T v_new. For L = <do, o> + <dv_out, v_new> + <dh, h'>
    the stage's outputs are dL/dq, dL/dk, dL/dv, dL/dβ, dL/dg (g in natural-log units) and dL/dM on M's strictly
    lower part, given dv = dL/dv_new (both of its paths) and dh."""
    B, T, H, K, V = 2, 100, 3, 16, 32
    scale = 0.3
    q, k, v, _, g2, beta, A_rows, h, do, dh, dv_out = stage_inputs(B, T, H, K, V, seed=3)
    gen = torch.Generator().manual_seed(4)
    NT = -(-T // BT)
    M = torch.tril(torch.randn(B, NT, H, BT, BT, generator=gen, dtype=torch.float64) * 0.2, -1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g2 * math.log(2), beta, M)]
    ql, kl, vl, gl, bl, Ml = leaves
    v_news, losses = [], 0
    for c in range(NT):
        s = slice(c * BT, min(T, c * BT + BT))
        n = s.stop - s.start
        A = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + Ml[:, c])[..., :n, :n]  # [B, H, n, n]
        qc, kc, vc, gc = (x[:, s].transpose(1, 2) for x in (ql, kl, vl, gl))             # [B, H, n, D]
        W = A * bl[:, s].transpose(1, 2)[..., None, :]
        kg = kc * gc.exp()
        v_new = W @ vc - (W @ kg) @ h[:, c]
        v_new.retain_grad()
        v_news.append(v_new)
        o = scale * (qc * gc.exp()) @ h[:, c]
        gn = gc[..., -1:, :]
        h_next = gn.transpose(-1, -2).exp() * h[:, c] + (kc * (gn - gc).exp()).transpose(-1, -2) @ v_new
        losses = losses + (o * do[:, s].transpose(1, 2)).sum() + (v_new * dv_out[:, s].transpose(1, 2)).sum() \
            + (h_next * dh[:, c]).sum()
    losses.backward()
    dv = torch.cat([x.grad for x in v_news], 2).transpose(1, 2)  # dL/dv_new: its own term and the state's
    A_rows = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + M).transpose(2, 3).reshape(B, NT * BT, H, BT)[:, :T]
    v_new_all = torch.cat([x.detach() for x in v_news], 2).transpose(1, 2)
    got = chunk_kda_bwd_wy_dqkg_ref(q, k, v, v_new_all, g2, beta, A_rows.contiguous(), h, do, dh, dv, scale)
    dq, dk, dv2, db, dg, dA = got
    for name, ours, want in (("dq", dq, ql.grad), ("dk", dk, kl.grad), ("dv2", dv2, vl.grad), ("db", db, bl.grad),
                             ("dg", dg, gl.grad)):
        torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-9, msg=name)
    strict = torch.tril(torch.ones(BT, BT, dtype=torch.bool), -1)
    dM = torch.where(strict, Ml.grad, 0)
    dA_chunks = torch.cat([dA, dA.new_zeros(B, NT * BT - T, H, BT)], 1).view(B, NT, BT, H, BT).transpose(2, 3)
    valid = torch.arange(NT * BT).view(NT, BT) < T
    dM = torch.where((valid[:, :, None] & valid[:, None, :])[None, :, None], dM, 0)  # padded rows: no tokens
    torch.testing.assert_close(dA_chunks, dM, rtol=1e-9, atol=1e-9)


def test_intra_reference_is_the_gradient_of_the_chunk_scores():
    """Per chunk: Aqk_ij = q_i · (k_j ⊙ e^(g_i - g_j)) for j <= i, Akk_ij = β_i k_i · (k_j ⊙ e^(g_i - g_j)) for j < i
    (g in natural-log units here); for L = <dAqk, Aqk> + <dAkk, Akk>, the intra stage adds dL/dq, dL/dk, dL/dβ and
    dL/dg to the gradients it is given."""
    B, T, H, K = 2, 100, 3, 16
    gen = torch.Generator().manual_seed(6)
    q, k, _, _, g2, beta, *_ = stage_inputs(B, T, H, K, 16, seed=6)
    dAqk, dAkk = (torch.randn(B, T, H, BT, generator=gen, dtype=torch.float64) for _ in range(2))
    given = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((B, T, H, K),) * 2 + ((B, T, H),)
             + ((B, T, H, K),)]
    leaves = [x.clone().requires_grad_() for x in (q, k, g2 * math.log(2), beta)]
    ql, kl, gl, bl = leaves
    loss = 0
    for c in range(-(-T // BT)):
        s = slice(c * BT, min(T, c * BT + BT))
        n = s.stop - s.start
        qc, kc, gc = (x[:, s].transpose(1, 2) for x in (ql, kl, gl))       # [B, H, n, K]
        decay = (gc[..., :, None, :] - gc[..., None, :, :]).clamp(max=0).exp()  # i >= j: exact; else masked below
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, decay)
        keys = bl[:, s].transpose(1, 2)[..., None] * torch.einsum("bhik,bhjk,bhijk->bhij", kc, kc, decay)
        on = torch.ones(n, n, dtype=torch.bool).tril()
        loss = loss + (torch.where(on, scores, 0) * dAqk[:, s, :, :n].transpose(1, 2)).sum() \
            + (torch.where(on.tril(-1), keys, 0) * dAkk[:, s, :, :n].transpose(1, 2)).sum()
    loss.backward()
    dq, dk, db, dg = chunk_kda_bwd_intra_ref(q, k, g2, beta, dAqk, dAkk, *given)
    for name, ours, base, want in (("dq", dq, given[0], ql.grad), ("dk", dk, given[1], kl.grad),
                                   ("db", db, given[2], bl.grad), ("dg", dg, given[3], gl.grad)):
        torch.testing.assert_close(ours - base, want, rtol=1e-9, atol=1e-9, msg=name)


SHAPES = [(1, 64, 1, 64, 64), (1, 100, 3, 128, 128), (3, 130, 1, 64, 32), (1, 40, 1, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_equals_reference(shape, dtype):
    pytest.importorskip("triton")
    from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 dots: the interpreter's case")
    seed = sum(shape) + (dtype == torch.float32)
    inputs = stage_inputs(*shape, dtype=dtype, device=DEVICE, seed=seed)
    got = chunk_kda_bwd_wy_dqkg(*inputs, 0.37)
    want = chunk_kda_bwd_wy_dqkg_ref(*inputs, 0.37)
    # fp32 on CUDA: tl.dot rounds its operands to TF32 (10-bit mantissa), as fla's kernels do
    tol = 1e-10 if dtype == torch.float64 else 2e-5 if DEVICE == "cpu" else 5e-3
    for name, ours, ref in zip(("dq", "dk", "dv2", "db", "dg", "dA"), got, want):
        assert ours.shape == ref.shape, name
        assert ours.dtype == (ref.dtype if name != "dv2" else inputs[2].dtype), name
        err = (ours.double() - ref.double()).abs().max() / ref.abs().max()
        assert err < tol, (name, err.item())


# (sequence lengths, H, K, V): chunks that end mid-sequence, sequences shorter than a chunk, exact multiples
VARLEN_SHAPES = [((64,), 1, 64, 64), ((50, 64, 130), 2, 32, 64), ((1, 127, 65, 3), 1, 16, 32)]


@pytest.mark.parametrize("lengths, H, K, V", VARLEN_SHAPES)
@pytest.mark.parametrize("dtype, index_dtype", [(torch.float64, torch.int64), (torch.float32, torch.int32)])
def test_varlen_kernel_equals_reference(lengths, H, K, V, dtype, index_dtype):
    """Sequences packed in one row (fla's varlen layout: cu_seqlens, chunk_indices, a state row a chunk) against the
    reference, which runs each sequence on its own."""
    pytest.importorskip("triton")
    from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 dots: the interpreter's case")
    inputs, cu, chunks = varlen_stage_inputs(lengths, H, K, V, dtype=dtype, device=DEVICE, seed=len(lengths) + K,
                                             index_dtype=index_dtype)
    got = chunk_kda_bwd_wy_dqkg(*inputs, 0.29, cu_seqlens=cu, chunk_indices=chunks)
    want = chunk_kda_bwd_wy_dqkg_ref(*inputs, 0.29, cu_seqlens=cu)
    tol = 1e-10 if dtype == torch.float64 else 2e-5 if DEVICE == "cpu" else 5e-3
    for name, ours, ref in zip(("dq", "dk", "dv2", "db", "dg", "dA"), got, want):
        assert ours.shape == ref.shape == inputs[{"dv2": 2, "db": 5, "dA": 6}.get(name, 0)].shape, name
        err = (ours.double() - ref.double()).abs().max() / ref.abs().max()
        assert err < tol, (name, err.item())


def test_varlen_call_without_its_chunk_table_or_over_several_rows_is_refused():
    pytest.importorskip("triton")
    from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

    inputs, cu, chunks = varlen_stage_inputs((70, 40), 1, 16, 16, seed=4)
    with pytest.raises(ValueError, match="chunk_indices"):
        chunk_kda_bwd_wy_dqkg(*inputs, 0.5, cu_seqlens=cu)
    two_rows = [x.expand(2, *x.shape[1:]) for x in inputs]
    with pytest.raises(ValueError, match="B = 1"):
        chunk_kda_bwd_wy_dqkg(*two_rows, 0.5, cu_seqlens=cu, chunk_indices=chunks)


def test_varlen_reference_runs_each_sequence_alone():
    """The reference's varlen form is the stage on each sequence by itself: one sequence of the pack, run alone,
    gives its slice of the packed result (and the packed result is not the one-row stage's, whose chunks would
    cross the sequences' bounds)."""
    inputs, cu, _ = varlen_stage_inputs((70, 40), 1, 16, 16, seed=3)
    packed = chunk_kda_bwd_wy_dqkg_ref(*inputs, 0.5, cu_seqlens=cu)
    q, k, v, v_new, g, beta, A, h, do, dh, dv = inputs
    second = [x[:, 70:] for x in (q, k, v, v_new, g, beta, A)] + [h[:, 2:], do[:, 70:], dh[:, 2:], dv[:, 70:]]
    alone = chunk_kda_bwd_wy_dqkg_ref(*second, 0.5)
    for ours, ref in zip(packed, alone):
        torch.testing.assert_close(ours[:, 70:], ref, rtol=0, atol=0)
    one_row = chunk_kda_bwd_wy_dqkg_ref(*inputs[:7], h[:, :2], do, dh[:, :2], dv, 0.5)
    assert not torch.allclose(packed[0], one_row[0])


INTRA_SHAPES = [(1, 64, 1, 32, False), (2, 100, 3, 64, False), (1, 130, 1, 128, True), (1, 40, 1, 16, True)]


# the intra kernel's forms, the diagonal dots' precisions and the sub form's early reads (k3.ops._kda_bwd_triton's
# INTRA_FORM, INTRA_DIAG, INTRA_EARLY); the interpreter takes no bf16x3 (CUDA's)
INTRA_VARIANTS = [("walk", "ieee", False), ("sub", "ieee", False), ("sub", "tf32x3", True)]
CUDA_INTRA_VARIANTS = [*INTRA_VARIANTS, ("sub", "bf16x3", False), ("sub", "bf16x3", True)]


def _intra_variant_id(variant):
    return f"{variant[0]}-{variant[1]}" + "-early" * variant[2]


def _use_intra_variant(monkeypatch, variant):
    from k3.ops import _kda_bwd_triton

    for name, value in zip(("INTRA_FORM", "INTRA_DIAG", "INTRA_EARLY"), variant):
        monkeypatch.setattr(_kda_bwd_triton, name, value)


@pytest.mark.parametrize("variant", INTRA_VARIANTS if DEVICE == "cpu" else CUDA_INTRA_VARIANTS, ids=_intra_variant_id)
@pytest.mark.parametrize("shape", INTRA_SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-strongest" * s[4]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_intra_kernel_equals_reference(shape, dtype, variant, monkeypatch):
    """Also at the strongest decays fla's safe gate allows (e^-5 a token): the sub-chunk anchors keep fp32 finite.
    Each form and diagonal precision (the interpreter computes every dot in fp32 or fp64: bf16x3's rounding is
    the CUDA tests' case)."""
    pytest.importorskip("triton")
    from k3.ops._kda_bwd_triton import chunk_kda_bwd_intra

    _use_intra_variant(monkeypatch, variant)

    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 dots: the interpreter's case")
    *dims, strongest = shape
    inputs = intra_inputs(*dims, dtype=dtype, device=DEVICE, seed=sum(dims), strongest=strongest)
    got = chunk_kda_bwd_intra(*inputs)
    want = chunk_kda_bwd_intra_ref(*[x.double() for x in inputs])
    tol = 1e-10 if dtype == torch.float64 else 2e-5 if DEVICE == "cpu" else 5e-3
    for name, ours, ref in zip(("dq", "dk", "db", "dg"), got, want):
        assert ours.shape == ref.shape and ours.dtype == dtype, name
        err = ((ours.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, err)


def _meta_call(**overrides):
    """fla's keyword arguments for small's training call (8 x 4096, H 12, K = V = 128), as meta tensors."""
    B, T, H, K, V = 8, 4096, 12, 128, 128
    bf = dict(device="meta", dtype=torch.bfloat16)
    f32 = dict(device="meta", dtype=torch.float32)
    call = dict(q=torch.empty(B, T, H, K, **bf), k=torch.empty(B, T, H, K, **bf), v=torch.empty(B, T, H, V, **bf),
                v_new=torch.empty(B, T, H, V, **bf), g=torch.empty(B, T, H, K, **f32),
                beta=torch.empty(B, T, H, **f32), A=torch.empty(B, T, H, 64, **bf),
                h=torch.empty(B, T // 64, H, K, V, **bf), do=torch.empty(B, T, H, V, **bf),
                dh=torch.empty(B, T // 64, H, K, V, **bf), dv=torch.empty(B, T, H, V, **bf), scale=K ** -0.5,
                state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None, chunk_offsets=None,
                use_graph=False)
    call.update(overrides)
    return call


def _meta_intra_call(**overrides):
    """fla's keyword arguments for small's chunk_kda_bwd_intra call (8 x 4096, H 12, K 128), as meta tensors."""
    B, T, H, K = 8, 4096, 12, 128
    bf = dict(device="meta", dtype=torch.bfloat16)
    f32 = dict(device="meta", dtype=torch.float32)
    call = dict(q=torch.empty(B, T, H, K, **bf), k=torch.empty(B, T, H, K, **bf), g=torch.empty(B, T, H, K, **f32),
                beta=torch.empty(B, T, H, **f32), dAqk=torch.empty(B, T, H, 64, **f32),
                dAkk=torch.empty(B, T, H, 64, **f32), dq=torch.empty(B, T, H, K, **f32),
                dk=torch.empty(B, T, H, K, **f32), db=torch.empty(B, T, H, **f32), dg=torch.empty(B, T, H, K, **f32),
                cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=True, use_graph=False)
    call.update(overrides)
    return call


@pytest.mark.parametrize("choice, wy, intra", [("k3", True, True), ("wy", True, False), ("intra", False, True),
                                               ("fla", False, False)])
def test_verifiers_take_the_training_calls_of_the_stages_switched_on(choice, wy, intra):
    with envs.override(kda_bwd=choice):
        for accepts, call, on in ((wy_dqkg_accepts, _meta_call(), wy), (intra_accepts, _meta_intra_call(), intra)):
            accepted, reason = accepts(**call)
            assert accepted == on and (reason is None) == on
            assert on or "K3_KDA_BWD" in reason


def _meta_varlen_call(docs: int = 64, doc_len: int = 512, **overrides):
    """fla's keyword arguments for small's call on packed documents (one row of 8 x 4096 tokens, documents of
    `doc_len`: bench_gpu_train.py --docs), as meta tensors."""
    T, H, K, V, NT = docs * doc_len, 12, 128, 128, docs * -(-doc_len // 64)
    bf = dict(device="meta", dtype=torch.bfloat16)
    call = _meta_call(q=torch.empty(1, T, H, K, **bf), k=torch.empty(1, T, H, K, **bf),
                      v=torch.empty(1, T, H, V, **bf), v_new=torch.empty(1, T, H, V, **bf),
                      g=torch.empty(1, T, H, K, device="meta"), beta=torch.empty(1, T, H, device="meta"),
                      A=torch.empty(1, T, H, 64, **bf), h=torch.empty(1, NT, H, K, V, **bf),
                      do=torch.empty(1, T, H, V, **bf), dh=torch.empty(1, NT, H, K, V, **bf),
                      dv=torch.empty(1, T, H, V, **bf),
                      cu_seqlens=torch.empty(docs + 1, dtype=torch.long, device="meta"),
                      chunk_indices=torch.empty(NT, 2, dtype=torch.long, device="meta"))
    call.update(overrides)
    return call


def test_verifier_takes_packed_documents():
    with envs.override(kda_bwd="k3"):
        assert wy_dqkg_accepts(**_meta_varlen_call()) == (True, None)
        assert wy_dqkg_accepts(**_meta_varlen_call(docs=3, doc_len=100)) == (True, None)  # chunks end mid-document
        accepted, reason = intra_accepts(**_meta_intra_call(cu_seqlens=torch.empty(65, device="meta"),
                                                             chunk_indices=torch.empty(512, 2, device="meta")))
    assert not accepted and "varlen" in reason


@pytest.mark.parametrize("overrides", [
    dict(chunk_indices=None),                                                    # fla builds it: its kernel runs
    dict(cu_seqlens=None),
    dict(chunk_indices=torch.empty(511, 2, dtype=torch.long, device="meta")),    # h has a row per chunk: 512
    dict(chunk_indices=torch.empty(512, 3, dtype=torch.long, device="meta")),
    dict(cu_seqlens=torch.empty(65, device="meta")),                             # float offsets
    dict(cu_seqlens=torch.empty(65, dtype=torch.long)),                          # on another device than k
    dict(use_graph=True),
], ids=["no_chunk_indices", "no_cu_seqlens", "chunk_count", "chunk_indices_shape", "float_offsets", "device",
        "graph"])
def test_verifier_declines_varlen_calls_the_kernels_do_not_cover(overrides):
    with envs.override(kda_bwd="k3"):
        accepted, reason = wy_dqkg_accepts(**_meta_varlen_call(**overrides))
    assert not accepted and reason


def test_verifier_declines_varlen_over_several_rows():
    with envs.override(kda_bwd="k3"):
        accepted, reason = wy_dqkg_accepts(**_meta_call(cu_seqlens=torch.empty(9, dtype=torch.long, device="meta"),
                                                        chunk_indices=torch.empty(512, 2, dtype=torch.long,
                                                                                  device="meta")))
    assert not accepted and "rows" in reason


@pytest.mark.parametrize("overrides", [
    dict(use_graph=True),
    dict(state_v_first=True),
    dict(chunk_size=32),
    dict(v=torch.empty(8, 4096, 24, 128, device="meta")),                        # more value heads than key heads
    dict(k=torch.empty(8, 4096, 12, 96, device="meta", dtype=torch.bfloat16)),   # K not a power of two
    dict(h=torch.empty(8, 64, 12, 128, 128, device="meta", dtype=torch.bfloat16).transpose(-1, -2)[:, :63]),
    dict(A=torch.empty(8, 4096, 12, 64, device="meta", dtype=torch.float64)),
    dict(k=torch.empty(1, 2 ** 21, 12, 128, device="meta", dtype=torch.bfloat16)),  # past int32 tile offsets
], ids=["graph", "v_first", "chunk32", "gva", "K96", "h_shape", "fp64", "int32"])
def test_verifier_declines_what_the_kernels_do_not_cover(overrides):
    with envs.override(kda_bwd="k3"):
        accepted, reason = wy_dqkg_accepts(**_meta_call(**overrides))
    assert not accepted and reason


@pytest.mark.parametrize("overrides", [
    dict(cu_seqlens=torch.tensor([0, 4096])),
    dict(use_graph=True),
    dict(chunk_size=32),
    dict(safe_gate=False),                                                       # decays unbounded: fp32 anchors
    dict(lower_bound=-8.0),
    dict(g=torch.empty(8, 4096, 24, 128, device="meta")),                        # more gate heads than key heads
    dict(k=torch.empty(8, 4096, 12, 96, device="meta", dtype=torch.bfloat16)),
    dict(dAkk=torch.empty(8, 4096, 12, 32, device="meta")),
    dict(db=torch.empty(8, 4096, 12, device="meta", dtype=torch.float64)),
    dict(k=torch.empty(1, 2 ** 21, 12, 128, device="meta", dtype=torch.bfloat16)),  # past int32 tile offsets
], ids=["varlen", "graph", "chunk32", "unsafe_gate", "bound_below_5", "gva", "K96", "dAkk_shape", "fp64", "int32"])
def test_intra_verifier_declines_what_the_kernel_does_not_cover(overrides):
    with envs.override(kda_bwd="k3"):
        assert intra_accepts(**_meta_intra_call(lower_bound=-5.0)) == (True, None)
        accepted, reason = intra_accepts(**_meta_intra_call(**overrides))
    assert not accepted and reason


def test_switch_parses():
    assert envs.parse({}).kda_bwd == "wy"
    for value in ("k3", "fla", "wy", "intra"):
        assert envs.parse({"K3_KDA_BWD": value}).kda_bwd == value
    with pytest.raises(ValueError):
        envs.parse({"K3_KDA_BWD": "tilelang"})


# small's training call of the WY stage (8 x 4096, H 12, K = V = 128; dtypes as fla's own kernel's spec in the table)
SMALL_WY_LAUNCH = """
import torch
from k3.ops import _kda_bwd_triton as kb
B, T, H, K, V = 8, 4096, 12, 128, 128
bf, f32 = dict(device="meta", dtype=torch.bfloat16), dict(device="meta", dtype=torch.float32)
e = torch.empty
kb.chunk_kda_bwd_wy_dqkg(e(B, T, H, K, **bf), e(B, T, H, K, **bf), e(B, T, H, V, **bf), e(B, T, H, V, **bf),
                         e(B, T, H, K, **f32), e(B, T, H, **f32), e(B, T, H, 64, **bf), e(B, T // 64, H, K, V, **bf),
                         e(B, T, H, V, **bf), e(B, T // 64, H, K, V, **bf), e(B, T, H, V, **bf), K ** -0.5)
# the same tokens as packed documents (bench_gpu_train.py --docs: one row, fla's int64 cu_seqlens and chunk_indices)
T, NT, i64 = B * T, B * T // 64, dict(device="meta", dtype=torch.int64)
kb.chunk_kda_bwd_wy_dqkg(e(1, T, H, K, **bf), e(1, T, H, K, **bf), e(1, T, H, V, **bf), e(1, T, H, V, **bf),
                         e(1, T, H, K, **f32), e(1, T, H, **f32), e(1, T, H, 64, **bf), e(1, NT, H, K, V, **bf),
                         e(1, T, H, V, **bf), e(1, NT, H, K, V, **bf), e(1, T, H, V, **bf), K ** -0.5,
                         cu_seqlens=e(65, **i64), chunk_indices=e(NT, 2, **i64))
"""


def test_the_precompile_table_holds_the_wy_stages_launches_at_smalls_shape():
    """The shipped table's H200 specs of _dqkg_kernel and _dv_dA_kernel are what the stage launches at small's
    training shape, in rows and as packed documents (same constants, warps, stages, register cap, argument types):
    a launch constant changed without them makes a fresh machine's precompile workers compile a kernel the step
    never runs. Re-record: tests/launch_spec_sm90.py's launch_specs(SMALL_WY_LAUNCH) in place of the table's
    entries."""
    from launch_spec_sm90 import launch_specs

    from k3.ops import tuning

    launched = launch_specs(SMALL_WY_LAUNCH)
    assert [s["name"] for s in launched] == ["k3.ops._kda_bwd_triton._dqkg_kernel",
                                             "k3.ops._kda_bwd_triton._dv_dA_kernel"] * 2
    compiles = tuning.load_table(tuning.TABLE_PATH)["NVIDIA H200"]["compiles"]
    shipped = [s for s in compiles if s["name"].startswith("k3.ops._kda_bwd_triton.")]
    assert shipped == launched
    # both before fla's own WY kernel, where the step meets them in its first-use order
    names = [s["name"] for s in compiles]
    assert names.index(launched[-1]["name"]) < names.index("fla.ops.kda.chunk_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused")


def _fla_or_skip():
    """Skip without CUDA; on CUDA without fla, skip unless K3_REQUIRE_FLA=1 (then fail)."""
    from k3.ops.kda_fla import fla_available

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not fla_available():
        if envs.current().require_fla:
            pytest.fail("K3_REQUIRE_FLA=1 but flash-linear-attention >= 0.6.0 does not import")
        pytest.skip("needs flash-linear-attention >= 0.6.0")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


BF16_REL = 2e-2  # both round dot operands to bf16 (or TF32), at different points (norm-wise relative error)


def _against_fla(names, ours, flas, exact=None):
    """Each output within BF16_REL of fla's; with `exact` (float64 outputs), also no further from them than fla's
    own are (2x, plus a floor for outputs both get to fp32 rounding)."""
    for i, (name, a, b) in enumerate(zip(names, ours, flas)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < BF16_REL, (name, _rel(a, b))
        if exact is not None:
            assert _rel(a, exact[i]) <= 2 * _rel(b, exact[i]) + 1e-5, (name, _rel(a, exact[i]), _rel(b, exact[i]))


@pytest.mark.parametrize("B", [8, 1])
def test_kernels_equal_flas_at_the_training_shape(B):
    """bf16 at B x 4096, H 12, K = V = 128 (small's call at B 8): every output against fla's own kernel, and at B 1
    both against the float64 reference on the same inputs."""
    _fla_or_skip()
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

    x = stage_inputs(B, 4096, 12, 128, 128, dtype=torch.bfloat16, device="cuda", seed=5)
    x[4], x[5] = x[4].float(), x[5].float()  # g and beta in fp32, as fla's backward passes them
    with envs.override(kda_bwd="fla"):  # fla's kernel even if k3's backend is registered
        want = chunk_kda_bwd_wy_dqkg_fused(*x, scale=128 ** -0.5)
    got = chunk_kda_bwd_wy_dqkg(*x, 128 ** -0.5)
    exact = chunk_kda_bwd_wy_dqkg_ref(*[t.double() for t in x], 128 ** -0.5) if B == 1 else None
    _against_fla(("dq", "dk", "dv2", "db", "dg", "dA"), got, want, exact)


def test_varlen_kernels_equal_flas_on_packed_documents():
    """bf16, H 12, K = V = 128, documents packed in one row as bench_gpu_train.py --docs packs them (512 tokens) and
    of lengths that end mid-chunk: every output against fla's own varlen kernel and both against float64."""
    _fla_or_skip()
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

    x, cu, chunks = varlen_stage_inputs([512] * 4 + [100, 700, 37, 1], 12, 128, 128, dtype=torch.bfloat16,
                                        device="cuda", seed=9)
    x[4], x[5] = x[4].float(), x[5].float()  # g and beta in fp32, as fla's backward passes them
    with envs.override(kda_bwd="fla"):
        want = chunk_kda_bwd_wy_dqkg_fused(*x, scale=128 ** -0.5, cu_seqlens=cu, chunk_indices=chunks)
    got = chunk_kda_bwd_wy_dqkg(*x, 128 ** -0.5, cu_seqlens=cu, chunk_indices=chunks)
    exact = chunk_kda_bwd_wy_dqkg_ref(*[t.double() for t in x], 128 ** -0.5, cu_seqlens=cu)
    _against_fla(("dq", "dk", "dv2", "db", "dg", "dA"), got, want, exact)


@pytest.mark.parametrize("variant", CUDA_INTRA_VARIANTS, ids=_intra_variant_id)
@pytest.mark.parametrize("B", [8, 1])
def test_intra_kernel_equals_flas_at_the_training_shape(B, variant, monkeypatch):
    """B x 4096, H 12, K 128, bf16 q and k, fp32 the rest, at the safe gate's strongest decays: every output
    against fla's own kernel (safe gate, bound -5), and at B 1 both against the float64 reference; each form and
    diagonal precision of k3's kernel."""
    _fla_or_skip()
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra as fla_intra

    from k3.ops._kda_bwd_triton import chunk_kda_bwd_intra

    _use_intra_variant(monkeypatch, variant)

    x = intra_inputs(B, 4096, 12, 128, dtype=torch.float32, device="cuda", seed=7, strongest=True)
    x[0], x[1] = x[0].bfloat16(), x[1].bfloat16()
    with envs.override(kda_bwd="fla"):
        want = fla_intra(*x, safe_gate=True, lower_bound=-5.0)
    got = chunk_kda_bwd_intra(*x)
    exact = chunk_kda_bwd_intra_ref(*[t.double() for t in x]) if B == 1 else None
    _against_fla(("dq", "dk", "db", "dg"), got, want, exact)


@pytest.mark.parametrize("choice", ["k3", "wy", "intra"])
def test_fla_kda_gated_gradients_with_k3s_backward(monkeypatch, choice):
    """fla_kda_gated forward + backward (small's heads, 2 x 1000 tokens: a partial last chunk) with K3_KDA_BWD=k3
    (wy, intra) equals K3_KDA_BWD=fla in every input gradient, and exactly the chosen stages ran k3's kernels."""
    _fla_or_skip()
    from k3.ops import _kda_bwd_triton
    from k3.ops.kda_fla import fla_kda_gated

    calls = []
    for stage in ("chunk_kda_bwd_wy_dqkg", "chunk_kda_bwd_intra"):
        original = getattr(_kda_bwd_triton, stage)
        monkeypatch.setattr(_kda_bwd_triton, stage,
                            lambda *a, _f=original, _s=stage: calls.append(_s) or _f(*a))
    B, T, H, K = 2, 1000, 12, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    inputs = [r(B, T, H, K).bfloat16() for _ in range(4)] + [r(B, T, H).bfloat16(), r(H) * 0.5, r(H * K)]
    do = r(B, T, H, K).bfloat16()
    grads = {}
    for which in ("fla", choice):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with envs.override(kda_bwd=which):
            o, _ = fla_kda_gated(*leaves, -5.0, recurrent=False)
            grads[which] = torch.autograd.grad(o, leaves, do)
    expected = {"k3": {"chunk_kda_bwd_wy_dqkg", "chunk_kda_bwd_intra"}, "wy": {"chunk_kda_bwd_wy_dqkg"},
                "intra": {"chunk_kda_bwd_intra"}}[choice]
    assert set(calls) == expected and len(calls) == len(expected), calls
    names = ("q", "k", "v", "f", "beta_logits", "A_log", "dt_bias")
    for name, ours, ref in zip(names, grads[choice], grads["fla"]):
        assert _rel(ours, ref) < BF16_REL, (name, _rel(ours, ref))
