"""The KDA mixer (SPEC §3.2): short convs, L2-normalised q/k, bounded decay gate, delta rule, gated output."""
import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import BatchCacheView, KDAState
from k3.model.norm import RMSNorm
from k3.ops.conv import short_conv
from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent
from k3.ops.kda_fla import fla_kda_gated, fla_output_gate, fla_usable, safe_gate_ok
from k3.ops.norm import l2_norm


def doc_ids_to_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows [B, T] → cu_seqlens over the flattened B·T tokens (a new segment at each row and doc start)."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = start.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int64)


def short_conv_varlen_index(cu_seqlens: torch.Tensor, num_tokens: int,
                            width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices for `short_conv_varlen` over S sequences (cu_seqlens [S+1], every one non-empty) of
    `num_tokens` tokens in all: each token's window [N, W] and each sequence's new tail [S, W−1], as positions
    in the buffer [tails (S·(W−1) rows) ; x (N rows)]. Computed on the device without reading it back."""
    dev, S, W = cu_seqlens.device, cu_seqlens.numel() - 1, width
    lens = cu_seqlens.diff()
    seg = torch.repeat_interleave(lens, output_size=num_tokens)  # each token's sequence (sized: no sync)

    def index(seq, local):  # position `local` in [tail_s ; x_s] (tail occupies −(W−1)…−1)
        in_x = local >= 0
        return torch.where(in_x, S * (W - 1) + cu_seqlens[seq] + local.clamp(min=0),
                           seq * (W - 1) + (W - 1) + local.clamp(max=-1))

    local = torch.arange(num_tokens, device=dev) - cu_seqlens[seg]
    taps = torch.arange(W, device=dev) - (W - 1)  # reads x[t − (W−1) + j]
    last = lens[:, None] + torch.arange(-(W - 1), 0, device=dev)
    return index(seg[:, None], local[:, None] + taps), index(torch.arange(S, device=dev)[:, None], last)


def short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor,
                      index: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` over S sequences flattened into one row, each continuing from its own tail.

    x: [N, C]; weight: [C, 1, W]; tails: [S, W−1, C]; index: `short_conv_varlen_index` of the layout.
    Returns (y [N, C] in x's dtype, new tails [S, W−1, C] in the compute dtype).
    """
    C = x.shape[1]
    S, W = tails.shape[0], weight.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    window, tail = index
    # One buffer holding every tail then every new input; each tap of each token is one gather from it.
    buf = torch.cat([tails.to(dt).reshape(S * (W - 1), C), x.to(dt)])
    y = torch.einsum("nwc,cw->nc", buf[window], weight[:, 0, :].to(dt))
    return y.to(x.dtype), buf[tail]


class ShortConv(nn.Module):
    """Depthwise causal conv weight [C, 1, W], kept in fp32 like the released checkpoint."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))

    def forward(self, x, tail=None, doc_ids=None):
        return short_conv(x, self.weight, tail, doc_ids)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        la = config.linear_attn_config
        D, H, K = config.hidden_size, la.num_heads, la.head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = la.gate_lower_bound
        W = la.short_conv_kernel_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = ShortConv(H * K, W)
        self.k_conv1d = ShortConv(H * K, W)
        self.v_conv1d = ShortConv(H * K, W)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_norm.weight.data = self.o_norm.weight.data.float()
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (already normalised). `cache` is the model's K3Cache (state read and written in place)."""
        if isinstance(cache, BatchCacheView):
            return self._forward_varlen(x, cache)
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        st = cache.kda_state(self.layer_idx) if cache is not None else None
        q, tq = self.q_conv1d(self.q_proj(x), st and st.conv_q, doc_ids)
        k, tk = self.k_conv1d(self.k_proj(x), st and st.conv_k, doc_ids)
        v, tv = self.v_conv1d(self.v_proj(x), st and st.conv_v, doc_ids)
        # GPU: gate, q/k L2 norm and beta sigmoid fused into fla's kernels (their gate needs safe_gate_ok)
        if fla_usable(q, K) and safe_gate_ok(self.lower_bound):
            o = self._inner_fla(x, q, k, v, doc_ids, st, (tq, tk, tv), cache)
            o = fla_output_gate(o, self.g_proj(x).view(B, T, H, K), self.o_norm.weight, self.o_norm.eps)
            return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))
        q = l2_norm(F.silu(q).view(B, T, H, K))
        k = l2_norm(F.silu(k).view(B, T, H, K))
        v = F.silu(v).view(B, T, H, K)
        beta = torch.sigmoid(self.b_proj(x).float() if x.dtype != torch.float64 else self.b_proj(x))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.lower_bound)

        if doc_ids is not None:  # packed rows: one flat batch of documents
            cu = doc_ids_to_cu_seqlens(doc_ids)
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
            o, _ = kda_chunk(flat(q), flat(k), flat(v), flat(g), flat(beta), cu_seqlens=cu,
                             gate_lower_bound=self.lower_bound)
            o = o.view(B, T, H, K)
        else:
            init = st.state if st is not None else None
            op = kda_recurrent if (cache is not None and T == 1) else kda_chunk
            o, state = op(q, k, v, g, beta, initial_state=init, output_final_state=cache is not None)
            if cache is not None:
                cache.set_kda_state(self.layer_idx, KDAState(state, tq, tk, tv))

        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(B, T, H, K).to(o.dtype))
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))

    def _inner_fla(self, x, q, k, v, doc_ids, st, tails, cache) -> torch.Tensor:
        """The delta rule through k3.ops.kda_fla.fla_kda_gated (same function as the reference path above).
        q, k, v: [B, T, H*K] conv outputs before SiLU. Returns o [B, T, H, K]; updates the cache like forward."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q, k, v = (F.silu(t).view(B, T, H, K) for t in (q, k, v))
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta_logits = self.b_proj(x)
        if doc_ids is not None:
            cu = doc_ids_to_cu_seqlens(doc_ids)
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
            o, _ = fla_kda_gated(flat(q), flat(k), flat(v), flat(f), flat(beta_logits), self.A_log, self.dt_bias,
                                 self.lower_bound, cu_seqlens=cu)
            return o.view(B, T, H, K)
        o, state = fla_kda_gated(q, k, v, f, beta_logits, self.A_log, self.dt_bias, self.lower_bound,
                                 initial_state=st.state if st is not None else None,
                                 output_final_state=cache is not None)
        if cache is not None:
            cache.set_kda_state(self.layer_idx, KDAState(state, *tails))
        return o

    def _forward_varlen(self, x: torch.Tensor, cache: BatchCacheView) -> torch.Tensor:
        """x: [1, N, D], S sequences laid out by the view; each continues from its own state. Decodes take the
        recurrent step, prefill chunks the chunked form, like K3Cache. Shapes and rows come from the view's
        host layout, so nothing is read back from the device."""
        N, H, K = x.shape[1], self.num_heads, self.head_dim
        W = self.q_conv1d.weight.shape[-1]
        conv_index = cache.shared(("short_conv", W), lambda: short_conv_varlen_index(cache.cu_seqlens, N, W))
        st = cache.kda_state(self.layer_idx)
        x2 = x[0]
        q, tq = short_conv_varlen(self.q_proj(x2), self.q_conv1d.weight, st.conv_q, conv_index)
        k, tk = short_conv_varlen(self.k_proj(x2), self.k_conv1d.weight, st.conv_k, conv_index)
        v, tv = short_conv_varlen(self.v_proj(x2), self.v_conv1d.weight, st.conv_v, conv_index)
        q = l2_norm(F.silu(q).view(N, H, K))
        k = l2_norm(F.silu(k).view(N, H, K))
        v = F.silu(v).view(N, H, K)
        beta = torch.sigmoid(self.b_proj(x2).float() if x.dtype != torch.float64 else self.b_proj(x2))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x2)).view(N, H, K), self.A_log, self.dt_bias, self.lower_bound)

        # Decodes and prefill chunks partition the sequences and the tokens: together they fill o and state.
        o = v.new_empty(N, H, K)
        state = torch.empty_like(st.state)
        if cache.decode_rows:  # a batch of single steps
            rows, t = cache.decode_rows_t, cache.decode_tokens_t
            od, sd = kda_recurrent(q[t, None], k[t, None], v[t, None], g[t, None], beta[t, None],
                                   initial_state=st.state[rows], output_final_state=True)
            o[t] = od[:, 0].to(o.dtype)
            state[rows] = sd.to(state.dtype)
        if cache.prefill_rows:  # one packed row of chunks
            rows, t = cache.prefill_rows_t, cache.prefill_tokens_t
            op, sp = kda_chunk(q[None, t], k[None, t], v[None, t], g[None, t], beta[None, t],
                               initial_state=st.state[rows], output_final_state=True,
                               cu_seqlens=cache.prefill_cu_seqlens, gate_lower_bound=self.lower_bound)
            o[t] = op[0].to(o.dtype)
            state[rows] = sp.to(state.dtype)
        cache.set_kda_state(self.layer_idx, KDAState(state, tq, tk, tv))
        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x2).view(N, H, K).to(o.dtype))
        return self.o_proj(o.reshape(1, N, H * K).to(x.dtype))
