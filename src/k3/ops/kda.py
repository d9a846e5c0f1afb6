"""Kimi Delta Attention (KDA) ops: bounded decay gate, step-by-step recurrence, chunkwise-parallel form.

Plain PyTorch references (any device, autograd-differentiable); they never dispatch to a kernel: the
model's KDA core, reference or fla, is chosen in k3.ops.kda_core. Layouts follow flash-linear-attention:
q, k, g: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H], recurrent state: [B, H, K, V] (K-first).

Recurrence per head (SPEC §3.2), with alpha_t = exp(g_t) (per key channel):
    S <- Diag(alpha_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from k3.ops.lazy_dynamo import assume_constant_result
from k3.ops.host_sync import host_reads_forbidden

__all__ = ["kda_gate", "kda_recurrent", "kda_chunk"]

# --------------------------------------------------------------------------------------------- gate


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """K3's bounded log-decay gate: g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).

    f: [..., H, K] low-rank gate projection (W_fb W_fa x) reshaped per head.
    A_log: [H'] with H' >= H (a padded parameter is allowed; the first H entries are used).
    dt_bias: [H * K] or [H, K].
    Returns g: [..., H, K] in float32 (float64 if f is float64), strictly inside (lower_bound, 0).
    """
    for name, t in (("f", f), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if f.dim() < 2:
        raise ValueError(f"f must be [..., H, K] with at least 2 dims, got shape {tuple(f.shape)}")
    H, K = f.shape[-2:]
    if A_log.dim() != 1 or A_log.shape[0] < H:
        raise ValueError(f"A_log must be 1-D with at least H={H} entries, got shape {tuple(A_log.shape)}")
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise ValueError(f"dt_bias must be [H*K]=[{H * K}] or [H, K]=[{H}, {K}], got {tuple(dt_bias.shape)}")
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, Real) or not (
        math.isfinite(lower_bound) and lower_bound < 0
    ):
        raise ValueError(f"lower_bound must be a finite negative number, got {lower_bound!r}")

    dtype = torch.float64 if f.dtype == torch.float64 else torch.float32
    rate = A_log[:H].to(dtype).exp().unsqueeze(-1)  # [H, 1]
    z = f.to(dtype) + dt_bias.to(dtype).reshape(H, K)
    g = lower_bound * torch.sigmoid(rate * z)
    # sigmoid saturates to exactly 0 or 1 in finite precision; keep g strictly inside the open interval
    # (lower_bound, 0) the spec promises, e.g. so that g < 0 holds for callers that check it.
    return g.clamp(min=_above(float(lower_bound), dtype), max=-torch.finfo(dtype).tiny)


@assume_constant_result  # a host number: torch.compile takes it as a constant, no graph break
def _above(bound: float, dtype: torch.dtype) -> float:
    """The `dtype` number next to `bound` towards zero."""
    return torch.nextafter(torch.tensor(bound, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()


# -------------------------------------------------------------------------------------- validation


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Validate the public arguments; return (B, T, H, K, V, document bounds or None)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must match q's shape [B, T, H, K]={list(q.shape)}, got {list(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with [B, T, H]={[B, T, H]}, got {list(v.shape)}")
    V = v.shape[3]
    if T and not host_reads_forbidden(g) and bool((g > 0).any()):
        raise ValueError("g must be <= 0 (it is a log-decay, e.g. from kda_gate)")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]={[B, T, H]}, got {list(beta.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)):
        raise ValueError(f"scale must be None or a real number, got {scale!r}")

    bounds = None
    n_seqs = B
    if cu_seqlens is not None:
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 2
            or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex()
            or cu_seqlens.dtype == torch.bool
        ):
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] with N >= 1")
        if B != 1:
            raise ValueError(f"cu_seqlens requires packed input with B == 1, got B={B}")
        cu = [int(x) for x in cu_seqlens.tolist()]
        if cu[0] != 0 or cu[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]}..{cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        bounds = list(zip(cu[:-1], cu[1:]))
        n_seqs = len(bounds)

    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating torch.Tensor")
        lead = "N" if cu_seqlens is not None else "B"
        if initial_state.shape != (n_seqs, H, K, V):
            raise ValueError(
                f"initial_state must be [{lead}, H, K, V]={[n_seqs, H, K, V]}, got {list(initial_state.shape)}"
            )
    return B, T, H, K, V, bounds


def _initial_states(initial_state, n_seqs, H, K, V, dtype, device, packed):
    """One starting state per processed sequence: [B, H, K, V] (batched) or N x [1, H, K, V] (packed)."""
    if initial_state is None:
        initial_state = torch.zeros(n_seqs, H, K, V, dtype=dtype, device=device)
    else:
        initial_state = initial_state.to(dtype)
    if packed:
        return [initial_state[i : i + 1] for i in range(n_seqs)]
    return [initial_state]


# --------------------------------------------------------------------------------------- recurrent


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time (the definition; slow, used as the reference).

    q, k: [B, T, H, K] (already L2-normalised), g: [B, T, H, K] log-decay (alpha = exp(g)),
    v: [B, T, H, V], beta: [B, T, H]. initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens).
    cu_seqlens: optional [N+1] cumulative document lengths for packed input (B == 1); the state restarts
    at each document. scale defaults to K ** -0.5. Math in float32 (float64 if any input is float64).
    Returns o: [B, T, H, V] in v's dtype, and the final state [B or N, H, K, V] (None unless
    output_final_state).
    """
    B, T, H, K, V, bounds = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    dtype = _compute_dtype(q, k, v, g, beta)
    out_dtype = v.dtype
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    alpha = g.to(dtype).exp()
    packed = bounds is not None
    if not packed:
        bounds = [(0, T)]
    states = _initial_states(initial_state, len(bounds) if packed else B, H, K, V, dtype, q.device, packed)

    # Per-step products are broadcast-multiply + sum rather than matmuls: at these sizes a threaded BLAS
    # call costs more than the arithmetic and stalls badly when cores are shared.
    outputs, finals = [], []
    for (start, end), S in zip(bounds, states):
        for t in range(start, end):
            S = S * alpha[:, t].unsqueeze(-1)
            k_t = k[:, t].unsqueeze(-1)  # [B, H, K, 1]
            error = v[:, t] - (k_t * S).sum(-2)  # [B, H, V]
            S = S + (beta[:, t, :, None, None] * k_t) * error.unsqueeze(-2)
            outputs.append((q[:, t].unsqueeze(-1) * S).sum(-2) * scale)
        finals.append(S)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    final_state = torch.cat(finals, dim=0) if output_final_state else None
    return o.to(out_dtype), final_state


# ------------------------------------------------------------------------------------------- chunk


# Limits on the exponents the chunked form exponentiates (float32 / float64). Factors within a sub-tile
# stay inside e^{+-_TILE_EXP}; decays below e^{_FLUSH_EXP} are set to exactly zero. Together they keep every
# factor, and every product of two factors, in the normal range: float32 underflow and denormal arithmetic
# are very slow CPU paths. A dropped term is < e^-20 ~ 2e-9 of its undecayed size, below float32 rounding
# (1.2e-7). In float64 with gates >= -5 nothing is ever flushed, so the float64 result is exact.
_TILE_EXP = {torch.float32: 40.0, torch.float64: 300.0}
_FLUSH_EXP = {torch.float32: -20.0, torch.float64: -350.0}


def _exp_flushed(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x) for x <= 0 where `keep` (default everywhere), with results below e^{_FLUSH_EXP} set to 0.

    Exponents are clamped into [floor, 0] before exp and dropped entries selected away afterwards: exp of
    -inf or of an underflowing value is a slow CPU path, and clamping keeps dropped entries' gradients
    finite (exactly zero).
    """
    floor = _FLUSH_EXP[x.dtype]
    kept = x >= floor if keep is None else (x >= floor) & keep
    return torch.where(kept, x.clamp(floor, 0.0).exp(), 0.0)


def _tile_length(g: torch.Tensor, chunk: int) -> int:
    """Sub-tile length whose in-tile factors e^{+-max|g| ceil((s-1)/2)} stay within e^{+-_TILE_EXP}.

    Prefers a divisor of the chunk (no padding); with gates >= -5 this gives 16-token tiles for 64-chunks
    in float32 and one tile per chunk in float64.
    """
    worst = float(g.detach().abs().max()) if g.numel() else 0.0
    if worst == 0.0:
        return chunk
    longest = max(1, min(chunk, 2 * int(_TILE_EXP[g.dtype] / worst) + 1))
    divisor = max(d for d in range(1, longest + 1) if chunk % d == 0)
    return divisor if 2 * divisor > longest else longest


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, tile: int) -> torch.Tensor:
    """M[t, j] = sum_c a[t, c] b[j, c] exp(G[t, c] - G[j, c]) for j <= t, else 0.

    a, b, G: [..., C, K] (broadcastable leading dims) with G non-increasing along C (a cumulative
    log-decay). Returns [..., C, C].
    exp(+G) is never formed. Inside a tile of `tile` positions the decay factors through the tile's middle
    position m: exp(G_t - G_m) * exp(G_m - G_j), each within e^{+-_TILE_EXP} (see _tile_length). Between
    tiles p > q it factors through the end e of tile q: exp(G_p - G_e) * exp(G_e - G_q), both <= 1.
    All products are batched matmuls.
    """
    C, K = a.shape[-2:]
    s = tile
    n = -(-C // s)
    pad = n * s - C
    if pad:
        # zero a, b in the padding; repeat the last G so no exponent there turns positive
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, K)], dim=-2)
        b = torch.cat([b, b.new_zeros(*b.shape[:-2], pad, K)], dim=-2)
        G = torch.cat([G, G[..., -1:, :].expand(*G.shape[:-2], pad, K)], dim=-2)
    a_t, b_t, G_t = (x.unflatten(-2, (n, s)) for x in (a, b, G))  # [..., n, s, K]

    # in-tile blocks [..., n, s(t), s(j)]; entries above the diagonal are bounded garbage, masked out
    G_mid = G_t[..., s // 2 : s // 2 + 1, :]
    in_tile = torch.ones(s, s, dtype=torch.bool, device=G.device).tril()
    diag = (a_t * (G_t - G_mid).exp()) @ (b_t * (G_mid - G_t).exp()).transpose(-1, -2)
    diag = torch.where(in_tile, diag, 0.0)
    if n == 1:
        return diag[..., 0, :C, :C]

    # tile pairs p > q, taken one offset d = p - q at a time so every operand is a slice, not a gather
    G_end = G_t[..., -1, :]  # [..., n, K]
    right = b_t * _exp_flushed(G_end.unsqueeze(-2) - G_t)  # [..., q, s, K]
    cross = []
    for d in range(1, n):
        left = a_t[..., d:, :, :] * _exp_flushed(G_t[..., d:, :, :] - G_end[..., : n - d, None, :])
        cross.append(left @ right[..., : n - d, :, :].transpose(-1, -2))  # [..., n - d, s, s]

    # assemble the n x n grid of blocks: in-tile on the diagonal, cross below, zeros above
    zero = diag.new_zeros(*diag.shape[:-3], 1, s, s)
    blocks = torch.cat([diag, *cross, zero], dim=-3)
    which = torch.full((n, n), blocks.shape[-3] - 1, dtype=torch.long)
    offset = 0
    for d in range(n):
        which[torch.arange(d, n), torch.arange(n - d)] = torch.arange(offset, offset + n - d)
        offset += n - d
    which = which.to(G.device)
    grid = blocks[..., which.flatten(), :, :].unflatten(-3, (n, n))  # [..., p, q, i, j]
    scores = grid.transpose(-3, -2).reshape(*grid.shape[:-4], n * s, n * s)
    return scores[..., :C, :C]


def _pack_chunk_aligned(x: torch.Tensor, bounds, chunk: int) -> torch.Tensor:
    """Concatenate x[:, start:end] for each bound along dim 1, each zero-padded to a multiple of chunk."""
    if len(bounds) == 1 and bounds[0] == (0, x.shape[1]) and x.shape[1] % chunk == 0:
        return x  # already aligned
    pieces = []
    for start, end in bounds:
        pieces.append(x[:, start:end])
        pad = -(end - start) % chunk
        if pad:
            pieces.append(x.new_zeros(x.shape[0], pad, *x.shape[2:]))
    return torch.cat(pieces, dim=1) if pieces else x[:, :0]


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA chunkwise-parallel: same contract and result as kda_recurrent, one state update per chunk.

    q, k: [B, T, H, K] (already L2-normalised), g: [B, T, H, K] log-decay, v: [B, T, H, V],
    beta: [B, T, H], initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens), any T.
    Returns o: [B, T, H, V] in v's dtype and the final state (None unless output_final_state).

    Within a chunk (positions t, cumulative log-decay G_t from the chunk start, state S0 at its start),
    the delta-rule corrections u_t = beta_t (v_t - (Diag(e^G_t) S0 + sum_{j<t} Diag(e^{G_t-G_j}) k_j u_j^T)^T k_t)
    satisfy (I + Diag(beta) A) u = Diag(beta) (V - (e^G * K) S0), A[t, j] = sum_c k_tc k_jc e^{G_tc-G_jc}
    (j < t): a unit lower-triangular system (UT transform) giving u = W_v - W_k S0. Then
    o = scale ((e^G * Q) S0 + A_qk u) and S1 = M S0 + R with M = Diag(e^G_last) - (e^{G_last-G} * K)^T W_k,
    R = (e^{G_last-G} * K)^T W_v. Everything except S1 = M S0 + R (one matmul per chunk) is batched over
    all chunks; no factor exp(+G) is ever formed (see _decayed_scores), so gates down to -5 are stable
    in float32. Requires g <= 0.
    """
    B, T, H, K, V, bounds = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    dtype = _compute_dtype(q, k, v, g, beta)
    out_dtype = v.dtype
    scale = K**-0.5 if scale is None else float(scale)
    C = chunk_size
    packed = bounds is not None
    if not packed:
        bounds = [(0, T)]
    states = _initial_states(initial_state, len(bounds) if packed else B, H, K, V, dtype, q.device, packed)

    # Lay sequences out so every one starts on a chunk boundary; zero padding (g = 0, beta = 0, k = 0)
    # leaves the state untouched, so padded chunks are exact.
    q, k, v, g, beta = (_pack_chunk_aligned(x.to(dtype), bounds, C) for x in (q, k, v, g, beta))
    n_chunks = q.shape[1] // C
    chunk_ranges, first = [], 0
    for start, end in bounds:
        count = -(-(end - start) // C)
        chunk_ranges.append((first, first + count))
        first += count

    def to_chunks(x):  # [B, Tp, H, D] -> [B, H, N, C, D]
        return x.transpose(1, 2).unflatten(2, (n_chunks, C))

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))
    beta = to_chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]

    # ---- everything independent of the carried state, batched over all chunks
    G = g.cumsum(dim=-2)  # log-decay from the chunk start, inclusive, <= 0
    tile = _tile_length(g, C)
    # both score matrices share every decay factor (columns are keys in both), so build them together
    scores = _decayed_scores(torch.stack([k, q], dim=-3), k.unsqueeze(-3), G.unsqueeze(-3), tile)
    A_kk = scores[..., 0, :, :].tril(-1)  # [B, H, N, C, C], strictly lower
    A_qk = scores[..., 1, :, :] * scale  # lower, diagonal included
    eye = torch.eye(C, dtype=dtype, device=q.device)
    L = eye + beta * A_kk  # unit lower triangular
    # (explicit inverse + one matmul is faster on CPU than a triangular solve with V + K right-hand sides)
    L_inv = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
    # products of small decays along the inverse's paths can reach the denormal range (slow CPU paths);
    # such entries are ~1e-30 and contribute nothing measurable, so they become exact zeros
    L_inv = torch.where(L_inv.abs() >= torch.finfo(dtype).tiny * 2.0**26, L_inv, 0.0)
    decay_in = _exp_flushed(G)  # chunk start -> t
    W = L_inv @ torch.cat([beta * v, beta * (k * decay_in)], dim=-1)  # [W_v | W_k]: u = W_v - W_k S0
    W_v, W_k = W.split([V, K], dim=-1)
    G_last = G[..., -1, :]  # [B, H, N, K]
    k_to_end = k * _exp_flushed(G_last.unsqueeze(-2) - G)  # [B, H, N, C, K]
    # chunk-level transition S1 = M S0 + R, so the sequential loop is one small matmul per chunk
    RM = k_to_end.transpose(-1, -2) @ W  # [B, H, N, K, V + K]
    R = RM[..., :V]
    M = torch.diag_embed(_exp_flushed(G_last)) - RM[..., V:]  # [B, H, N, K, K]
    M, R = (x.permute(2, 0, 1, 3, 4).flatten(1, 2).contiguous() for x in (M, R))  # [N, B*H, ., .]

    # ---- the sequential part
    chunk_states = [None] * n_chunks
    finals = []
    for (c0, c1), S in zip(chunk_ranges, states):
        S = S.flatten(0, 1)  # [B*H, K, V]
        for n in range(c0, c1):
            chunk_states[n] = S
            S = torch.baddbmm(R[n], M[n], S)
        finals.append(S.unflatten(0, (-1, H)))

    if n_chunks:
        S0 = torch.stack(chunk_states, dim=1).unflatten(0, (B, H))  # [B, H, N, K, V]
        reads = torch.cat([W_k, q * decay_in * scale], dim=-2) @ S0  # [B, H, N, 2C, V]
        u = W_v - reads[..., :C, :]
        o = reads[..., C:, :] + A_qk @ u  # [B, H, N, C, V]
        o = o.flatten(2, 3).transpose(1, 2)  # [B, Tp, H, V]
        pieces = [o[:, c0 * C : c0 * C + (end - start)] for (c0, _), (start, end) in zip(chunk_ranges, bounds)]
        o = torch.cat(pieces, dim=1)
    else:
        o = torch.zeros(B, 0, H, V, dtype=dtype, device=q.device)
    final_state = torch.cat(finals, dim=0) if output_final_state else None
    return o.to(out_dtype), final_state
