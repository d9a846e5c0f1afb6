"""KDA ops: chunkwise == recurrent (values, states, gradients), stability, packed sequences, gate, errors."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent

F64 = torch.float64


def make_inputs(B, T, H, K, V, seed, dtype=F64, gate_scale=4.0, with_state=False):
    """Random KDA inputs; gates come through kda_gate and cover most of (-5, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    g = kda_gate(gate_scale * randn(B, T, H, K), 0.5 * randn(H + 2), randn(H * K))
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    h0 = randn(B, H, K, V) if with_state else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return tuple(cast(x) for x in (q, k, v, g, beta, h0))


CASES = [
    # B, T, H, K, V, chunk_size, with_state
    (2, 50, 3, 8, 8, 16, False),
    (1, 100, 2, 16, 8, 64, True),  # K != V, T not a multiple of the chunk
    (2, 37, 2, 8, 12, 16, True),
    (1, 130, 1, 8, 8, 64, False),
    (1, 64, 2, 4, 4, 64, True),  # exactly one chunk
    (3, 5, 2, 4, 6, 16, True),  # shorter than one chunk
]


@pytest.mark.parametrize("case_index", range(len(CASES)))
def test_chunk_matches_recurrent_float64(case_index):
    B, T, H, K, V, chunk, with_state = CASES[case_index]
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=case_index, with_state=with_state)
    assert g.min() < -4.5  # gates really reach the -5 end
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk)
    assert o.shape == (B, T, H, V) and o.dtype == F64
    assert s.shape == (B, H, K, V) and s.dtype == F64
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def test_final_state_is_none_unless_asked():
    q, k, v, g, beta, _ = make_inputs(1, 10, 1, 4, 4, seed=7)
    assert kda_recurrent(q, k, v, g, beta)[1] is None
    assert kda_chunk(q, k, v, g, beta)[1] is None


def test_chunk_gradients_match_recurrent_float64():
    q, k, v, g, beta, h0 = make_inputs(1, 20, 2, 4, 6, seed=11, with_state=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(12)
    w_o = torch.randn(1, 20, 2, 6, generator=gen, dtype=F64)
    w_s = torch.randn(1, 2, 4, 6, generator=gen, dtype=F64)

    def grads(fn, **kw):
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), leaves)

    ref = grads(kda_recurrent)
    got = grads(kda_chunk, chunk_size=8)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], got, ref):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("tile_exp, chunk", [(5.0, 16), (12.0, 64), (5.0, 37)])
def test_tiled_scores_match_recurrent_float64(monkeypatch, tile_exp, chunk):
    """Force short sub-tiles in float64 (normally one tile per chunk) to check the across-tile path."""
    import k3.ops.kda as kda_module

    monkeypatch.setitem(kda_module._TILE_EXP, F64, tile_exp)
    q, k, v, g, beta, h0 = make_inputs(1, 90, 2, 8, 6, seed=int(tile_exp) + chunk, with_state=True)
    assert kda_module._tile_length(g, chunk) < chunk  # really tiled
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    w_o = torch.randn(1, 90, 2, 6, generator=torch.Generator().manual_seed(chunk), dtype=F64)

    def run(fn, **kw):
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
        return (o, s, *torch.autograd.grad((o * w_o).sum() + s.sum(), leaves))

    for got, ref in zip(run(kda_chunk, chunk_size=chunk), run(kda_recurrent)):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)


def test_float32_chunk_stable_with_strong_decay():
    """Gates near -5 push the in-chunk cumulative log-decay to about -320; float32 must stay accurate."""
    B, T, H, K, V = 1, 512, 2, 32, 32
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, V, seed=3, with_state=True)
    gen = torch.Generator().manual_seed(4)
    g = -5.0 + 0.05 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    g[..., ::4] = -0.05 * torch.rand(B, T, H, K // 4, generator=gen, dtype=F64)  # some slow channels too
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g, beta, h0)]
    o, s = kda_chunk(*f32[:5], initial_state=f32[5], output_final_state=True, chunk_size=64)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-4)


def test_recurrent_matches_explicit_matrix_form():
    """S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T, o_t = scale S_t^T q_t, written with eye."""
    B, T, H, K, V = 2, 12, 2, 5, 3
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=21, with_state=True)
    scale = 0.37
    o, s = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    eye = torch.eye(K, dtype=F64)
    for b in range(B):
        for h in range(H):
            S = h0[b, h]
            for t in range(T):
                kt, vt, qt, bt = k[b, t, h], v[b, t, h], q[b, t, h], beta[b, t, h]
                S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ S + bt * torch.outer(kt, vt)
                torch.testing.assert_close(o[b, t, h], scale * S.T @ qt, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(s[b, h], S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn_name", ["recurrent", "chunk"])
def test_packed_documents_match_separate_runs(fn_name):
    fn = {"recurrent": kda_recurrent, "chunk": lambda *a, **kw: kda_chunk(*a, chunk_size=16, **kw)}[fn_name]
    lengths = [5, 0, 40, 17, 16]
    H, K, V = 2, 8, 6
    T = sum(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, seed=31)
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(32), dtype=F64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, H, V) and s.shape == (len(lengths), H, K, V)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if start == end:  # an empty document passes its state through untouched
            torch.testing.assert_close(s[i], h0[i], rtol=0, atol=0)
            continue
        piece = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_i, s_i = kda_recurrent(*piece, initial_state=h0[i : i + 1], output_final_state=True)
        torch.testing.assert_close(o[:, start:end], o_i, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[i : i + 1], s_i, rtol=1e-10, atol=1e-10)
    # without initial states every document starts from zero
    o0, _ = fn(q, k, v, g, beta, cu_seqlens=cu)
    o_last, _ = kda_recurrent(*(x[:, T - 16 :] for x in (q, k, v, g, beta)))
    torch.testing.assert_close(o0[:, T - 16 :], o_last, rtol=1e-10, atol=1e-10)


def test_gate_formula_and_layouts():
    gen = torch.Generator().manual_seed(41)
    H, K = 3, 4
    f = torch.randn(2, 5, H, K, generator=gen, dtype=F64)
    A_log = torch.randn(H + 3, generator=gen, dtype=F64)  # padded: only the first H entries count
    dt_bias = torch.randn(H, K, generator=gen, dtype=F64)
    expected = -5.0 / (1.0 + torch.exp(-A_log[:H].exp()[:, None] * (f + dt_bias)))
    g = kda_gate(f, A_log, dt_bias)
    assert g.dtype == F64
    torch.testing.assert_close(g, expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias.flatten()), expected, rtol=1e-14, atol=1e-14)
    g2 = kda_gate(f, A_log, dt_bias, lower_bound=-2.0)
    torch.testing.assert_close(g2, expected * 2.0 / 5.0, rtol=1e-14, atol=1e-14)
    assert kda_gate(f.to(torch.bfloat16), A_log, dt_bias).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gate_strictly_inside_bounds_for_huge_inputs(dtype):
    H, K = 2, 3
    f = torch.tensor([1e30, -1e30, 1e4, -1e4, 50.0, -200.0], dtype=dtype).reshape(1, H, K)
    for lower_bound in (-5.0, -1.0):
        g = kda_gate(f, torch.zeros(H), torch.zeros(H * K), lower_bound=lower_bound)
        assert (g > lower_bound).all() and (g < 0).all()
        assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def _good(B=1, T=6, H=2, K=4, V=3):
    return make_inputs(B, T, H, K, V, seed=51)[:5]


BAD_CALLS = {
    "k shape": lambda q, k, v, g, b: dict(k=k[:, :, :, :3]),
    "g shape": lambda q, k, v, g, b: dict(g=g[:, :5]),
    "v shape": lambda q, k, v, g, b: dict(v=v[:, :, :1]),
    "q rank": lambda q, k, v, g, b: dict(q=q[0], k=k[0], g=g[0]),
    "beta shape": lambda q, k, v, g, b: dict(beta=b.unsqueeze(-1)),
    "int dtype": lambda q, k, v, g, b: dict(v=v.long()),
    "positive g": lambda q, k, v, g, b: dict(g=-g),
    "state shape": lambda q, k, v, g, b: dict(initial_state=torch.zeros(1, 2, 3, 4, dtype=F64)),
    "cu with B>1": lambda q, k, v, g, b: dict(
        q=q.expand(2, -1, -1, -1), k=k.expand(2, -1, -1, -1), v=v.expand(2, -1, -1, -1),
        g=g.expand(2, -1, -1, -1), beta=b.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 6])),
    "cu end": lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0, 5])),
    "cu start": lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([1, 6])),
    "cu decreasing": lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0, 4, 3, 6])),
    "cu float": lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0.0, 6.0])),
    "cu state count": lambda q, k, v, g, b: dict(
        cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, 2, 4, 3, dtype=F64)),
}


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunk], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("what", sorted(BAD_CALLS))
def test_bad_inputs_raise(fn, what):
    q, k, v, g, beta = _good()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(BAD_CALLS[what](q, k, v, g, beta))
    with pytest.raises(ValueError):
        fn(**args)


def test_bad_chunk_size_and_gate_args_raise():
    q, k, v, g, beta = _good()
    for chunk_size in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk_size"):
            kda_chunk(q, k, v, g, beta, chunk_size=chunk_size)
    f = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(2), torch.zeros(12))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, torch.zeros(3), torch.zeros(11))
    with pytest.raises(ValueError, match="f"):
        kda_gate(f.long(), torch.zeros(3), torch.zeros(12))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, torch.zeros(3), torch.zeros(12), lower_bound=1.0)
