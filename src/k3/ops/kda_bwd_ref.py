"""Plain PyTorch reference of KDA's chunk-backward stage through the chunk states and the WY form (what fla 0.6's
`chunk_kda_bwd_wy_dqkg_fused` and k3.ops._kda_bwd_triton compute; layouts as there). Never dispatches; float64
in, float64 out. Written as the chunk formulas read (dw formed, dA's parts summed), not as the kernel regroups them.
`stage_inputs`, `varlen_stage_inputs`, `intra_inputs`: random inputs of each stage in those layouts, for the tests
and benchmarks/bench_gpu_kernels.py.

`chunk_kda_bwd_intra_ref`: the stage after it (fla's `chunk_kda_bwd_intra`), the gradients through the chunk's
intra-chunk score matrices Aqk and Akk, added to what the WY/state stage gave.
"""
import itertools
import math

import torch

CHUNK = 64


def _chunks(x: torch.Tensor, BT: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, NT, H, BT, ...] zero-padded to a whole number of chunks."""
    B, T = x.shape[:2]
    NT = -(-T // BT)
    pad = torch.zeros(B, NT * BT - T, *x.shape[2:], dtype=x.dtype, device=x.device)
    x = torch.cat([x, pad], 1).reshape(B, NT, BT, *x.shape[2:])
    return x.transpose(2, 3)


def _unchunk(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, NT, H, BT, ...] -> [B, T, H, ...]."""
    B, NT, H, BT = x.shape[:4]
    return x.transpose(2, 3).reshape(B, NT * BT, H, *x.shape[4:])[:, :T]


def chunk_kda_bwd_wy_dqkg_ref(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale, chunk_size: int = CHUNK,
                              cu_seqlens=None):
    """(dq, dk, dv2, db, dg, dA), all in the promoted float dtype of the inputs (at least float32). g: base-2 log
    decay, cumulated within each chunk; A [B, T, H, BT]: the chunk's lower-triangular WY matrix, row t of the chunk
    at token t; h, dh [B, NT, H, K, V]: the state entering each chunk and its gradient; dv: the gradient of v_new.
    cu_seqlens [N + 1] (B = 1): the row holds N sequences, each chunked from its own first token, h and dh a row
    per chunk, the sequences' in order (fla's varlen layout): each sequence is the stage on its own."""
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens]
        outs, first = [], 0
        for bos, eos in zip(bounds, bounds[1:]):
            n = -(-(eos - bos) // chunk_size)
            seq = [x[:, bos:eos] for x in (q, k, v, v_new, g, beta, A)]
            h_seq, dh_seq = h[:, first:first + n], dh[:, first:first + n]
            outs.append(chunk_kda_bwd_wy_dqkg_ref(*seq, h_seq, do[:, bos:eos], dh_seq, dv[:, bos:eos], scale,
                                                  chunk_size))
            first += n
        return tuple(torch.cat(parts, 1) for parts in zip(*outs))
    BT = chunk_size
    T = q.shape[1]
    dt = torch.promote_types(torch.float32, q.dtype)
    c = lambda x: _chunks(x.to(dt), BT)  # noqa: E731
    q, k, v, v_new, g, do, dv = (c(x) for x in (q, k, v, v_new, g, do, dv))
    beta = c(beta)[..., None]                              # [B, NT, H, BT, 1]
    A = c(A)                                               # [B, NT, H, BT, BT]
    h, dh = h.to(dt), dh.to(dt)
    valid = _chunks(torch.ones(1, T, 1, dtype=dt, device=q.device), BT)[0, ..., None]  # [NT, 1, BT, 1]
    n_valid = valid.sum(-2).long()                         # [NT, 1, 1] tokens in each chunk
    gn = torch.gather(g, 3, (n_valid - 1).view(1, -1, 1, 1, 1).expand(*g.shape[:3], 1, g.shape[-1]))  # last row

    eg = torch.exp2(g) * valid
    kg = k * eg
    dq = scale * eg * (do @ h.transpose(-1, -2))
    dk_h = torch.exp2(gn - g) * valid * (v_new @ dh.transpose(-1, -2))  # through the chunk's state update
    dw = -(dv @ h.transpose(-1, -2))                       # gradient of w (v_new = u - w h)
    At = A.transpose(-1, -2)
    dkgb = At @ dw
    dvb = At @ dv
    dv2 = beta * dvb
    db = (dvb * v).sum(-1) + (dkgb * kg).sum(-1)
    dA = dv @ v.transpose(-1, -2) + dw @ kg.transpose(-1, -2)
    dgn = torch.exp2(gn[..., 0, :]) * (h * dh).sum(-1) + (k * dk_h).sum(-2)  # [B, NT, H, K]
    last = torch.arange(BT, device=q.device).view(BT, 1) == (n_valid - 1).view(-1, 1, 1, 1)  # [NT, 1, BT, 1]
    dg = q * dq - k * dk_h + last * dgn[..., None, :] + kg * dkgb * beta
    dk = dk_h + dkgb * eg * beta
    strict = torch.tril(torch.ones(BT, BT, dtype=torch.bool, device=q.device), -1) \
        & (valid * valid.transpose(-1, -2)).bool()
    dA = torch.where(strict, dA * beta.transpose(-1, -2), 0)
    dA = torch.where(strict, -(At @ dA @ At), 0)
    return tuple(_unchunk(x, T) for x in (dq, dk, dv2, db, dg, dA))


def chunk_kda_bwd_intra_ref(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size: int = CHUNK):
    """(dq, dk, db, dg) with the intra-chunk parts added, in the promoted float dtype (at least float32). Within a
    chunk, with E_ij = 2^(g_i - g_j) (per key channel; g base-2, cumulated within the chunk), the scores are
    Aqk_ij = q_i · (k_j ⊙ E_ij) for j <= i and Akk_ij = β_i k_i · (k_j ⊙ E_ij) for j < i; dAqk, dAkk
    [B, T, H, BT] are their gradients (row i at token i; only those entries are read). dg is the gradient of g
    before the chunk's reverse cumsum, in natural-log units (d/dg of 2^g taken as 2^g)."""
    BT = chunk_size
    T = q.shape[1]
    dt = torch.promote_types(torch.float32, q.dtype)
    c = lambda x: _chunks(x.to(dt), BT)  # noqa: E731
    q, k, g, dAqk, dAkk = (c(x) for x in (q, k, g, dAqk, dAkk))
    beta = c(beta)[..., None]                                  # [B, NT, H, BT, 1]
    lower = torch.tril(torch.ones(BT, BT, dtype=torch.bool, device=q.device))
    diff = g[..., :, None, :] - g[..., None, :, :]             # [B, NT, H, BT(i), BT(j), K]
    E = torch.exp2(torch.where(lower[..., None], diff, float("-inf")))
    dAqk = torch.where(lower, dAqk, 0)
    dAkk = torch.where(lower.tril(-1), dAkk, 0)
    dq_in = torch.einsum("...ij,...jk,...ijk->...ik", dAqk, k, E)
    dk_row = torch.einsum("...ij,...jk,...ijk->...ik", dAkk, k, E)       # Akk's row side, before β_i
    dk_col = torch.einsum("...ij,...ik,...ijk->...jk", dAqk, q, E) \
        + torch.einsum("...ij,...ik,...ijk->...jk", dAkk, beta * k, E)   # both scores' column side
    dq = dq.to(dt) + _unchunk(dq_in, T)
    db = db.to(dt) + _unchunk((dk_row * k).sum(-1), T)
    dk = dk.to(dt) + _unchunk(beta * dk_row + dk_col, T)
    dg = dg.to(dt) + _unchunk(q * dq_in + (beta * dk_row - dk_col) * k, T)
    return dq, dk, db, dg


def stage_inputs(B, T, H, K, V, dtype=torch.float64, device="cpu", seed=0, chunk_size: int = CHUNK):
    """(q, k, v, v_new, g, beta, A, h, do, dh, dv) as the stage receives them: g a base-2 log-decay cumulated within
    each chunk (per-token decays in (2^-0.3, 1]), beta in (0, 1), k scaled like an L2-normalised key, A the chunk's
    WY matrix built from them as the forward does; the rest standard normal. Contiguous."""
    BT = chunk_size
    gen = torch.Generator(device=device).manual_seed(seed)
    f = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f, device=device)  # noqa: E731
    NT = -(-T // BT)
    q, k = r(B, T, H, K), r(B, T, H, K) / math.sqrt(K)
    v, v_new, do, dv = (r(B, T, H, V) for _ in range(4))
    decay = torch.rand(B, NT, BT, H, K, generator=gen, dtype=f, device=device) * -0.3
    g = decay.cumsum(2).view(B, NT * BT, H, K)[:, :T]
    beta = torch.rand(B, T, H, generator=gen, dtype=f, device=device)
    # A as the forward builds it: (I + L)^-1, L_ij = β_i k_i · (k_j ⊙ 2^(g_i - g_j)) for j < i (the chunk's decay is
    # at most 2^-19 here, so the factors about its first row stay finite)
    kc, gc, bc = (_chunks(x, BT) for x in (k, g, beta[..., None]))    # [B, NT, H, BT, K], beta [.., 1]
    g0 = gc[..., :1, :]
    lower = torch.tril((bc * kc * torch.exp2(gc - g0)) @ (kc * torch.exp2(g0 - gc)).transpose(-1, -2), -1)
    A = torch.linalg.inv(torch.eye(BT, dtype=f, device=device) + lower)  # [B, NT, H, BT, BT]: row i of chunk
    A = A.transpose(2, 3).reshape(B, NT * BT, H, BT)[:, :T]
    h, dh = r(B, NT, H, K, V), r(B, NT, H, K, V)
    return [x.to(dtype).contiguous() for x in (q, k, v, v_new, g, beta, A, h, do, dh, dv)]


def varlen_stage_inputs(lengths, H, K, V, dtype=torch.float64, device="cpu", seed=0, chunk_size: int = CHUNK,
                        index_dtype=torch.int64):
    """(inputs, cu_seqlens, chunk_indices) of a varlen call over sequences of `lengths` packed in one row: each
    sequence's `stage_inputs` (its own chunks, from its first token), joined along T (h, dh: along their chunks);
    cu_seqlens [N + 1] and chunk_indices [NT, 2] (sequence, chunk within it) as fla builds them."""
    parts = [stage_inputs(1, n, H, K, V, dtype=dtype, device=device, seed=seed + i, chunk_size=chunk_size)
             for i, n in enumerate(lengths)]
    inputs = [torch.cat(xs, 1) for xs in zip(*parts)]
    chunks = [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // chunk_size))]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=index_dtype, device=device)
    return inputs, cu_seqlens, torch.tensor(chunks, dtype=index_dtype, device=device).view(-1, 2)


def intra_inputs(B, T, H, K, dtype=torch.float64, device="cpu", seed=0, strongest=False, chunk_size: int = CHUNK):
    """(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg) as chunk_kda_bwd_intra receives them. g: per-token decays in
    (2^-0.3, 1], or with `strongest` down to fla's safe-gate bound e^-5 (what the kernel's anchoring must survive
    in fp32: a chunk's decay reaches 2^-460); dAkk zero on and above its diagonal, as the WY stage leaves it."""
    BT = chunk_size
    q, k, _, _, g, beta, *_ = stage_inputs(B, T, H, K, 16, dtype=dtype, device=device, seed=seed, chunk_size=BT)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    f = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=gen, dtype=f, device=device)  # noqa: E731
    if strongest:
        NT = -(-T // BT)
        decay = torch.rand(B, NT, BT, H, K, generator=gen, dtype=f, device=device) * (-5 / math.log(2))
        g = decay.cumsum(2).view(B, NT * BT, H, K)[:, :T].to(dtype).contiguous()
    dAqk, dAkk = r(B, T, H, BT), r(B, T, H, BT)
    row = torch.arange(T, device=device) % BT
    dAkk = torch.where(torch.arange(BT, device=device) < row[:, None, None], dAkk, 0)
    dq, dk, dg = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    db = r(B, T, H)
    return [q, k, g, beta] + [x.to(dtype).contiguous() for x in (dAqk, dAkk, dq, dk, db, dg)]
