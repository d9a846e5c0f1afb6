"""The KDA mixer (SPEC §3.2): short convs, L2-normalised q/k, bounded decay gate, delta rule, gated output.

One forward for every use: features (projections, short convs, SiLU) → core (k3.ops.kda_core, whose backend
is picked there) → output (gated RMSNorm, o_proj). What differs between training, packed documents, decode,
serving and context parallelism is the layout: where the tokens' conv tails and states come from and go to.
`DenseLayout` covers rows with an optional K3Cache/StaticCache, `VarlenLayout` the serving engine's flat batch
(a BatchCacheView); k3.parallel.context_parallel supplies its own as the `cache` argument."""
import torch
import torch.nn.functional as F
from torch import nn

from k3 import envs
from k3.config import K3Config
from k3.model.cache import BatchCacheView, KDASlots, KDAState, StaticCache
from k3.model.norm import RMSNorm
from k3.ops.conv import short_conv
from k3.ops.fused_linear import FusedLinears, StackedWeights, joined_columns
from k3.ops.gemv import DecodeLinear
from k3.ops.kda_core import kda_core, select_backend
from k3.ops.kda_decode import DecodeWeights, kda_decode_step, use_fused_decode
from k3.ops.kda_fla import fla_output_gate
from k3.ops.triton_dispatch import triton_module, use_triton
from k3.ops.varlen_attention import packed_documents


def doc_ids_to_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows [B, T] → cu_seqlens (int64) over the flattened B·T tokens (a new segment at each row and doc
    start): the documents' segments of k3.ops.varlen_attention.packed_documents, read back once a forward and
    shared with MLA's attention over them."""
    return packed_documents(doc_ids, doc_ids.device).segments.cu_q.to(torch.int64)


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

    def forward(self, x, tail=None, doc_ids=None, silu: bool = False, l2_head: int | None = None):
        return short_conv(x, self.weight, tail, doc_ids, silu, l2_head)


class DenseLayout:
    """Rows [B, T] continuing from a K3Cache/StaticCache (or from nothing); packed documents when doc_ids."""

    def __init__(self, cache=None, doc_ids: torch.Tensor | None = None):
        self.cache, self.doc_ids = cache, doc_ids
        self.qk_normalized = False  # whether short_convs gave q and k L2-normalised (the core then does not)

    def short_convs(self, m: "KimiDeltaAttention", xs: list[torch.Tensor]):
        """(SiLU(conv(x)) for q, k, v; their new tails): the SiLU in the conv's kernels where they run. Where a
        gradient is recorded (training) q's and k's per-head L2 norms too, unless K3_NO_QK_NORM_FOLD=1: in the
        kernels' passes each way, where the core's norms are a pass of their own each way (k3.envs)."""
        st = self.cache.kda_state(m.layer_idx) if self.cache is not None else None
        tails = (st.conv_q, st.conv_k, st.conv_v) if st is not None else (None,) * 3
        self.qk_normalized = torch.is_grad_enabled() and not envs.current().no_qk_norm_fold
        heads = (m.head_dim, m.head_dim, None) if self.qk_normalized else (None,) * 3
        outs = [conv(x, tail, self.doc_ids, silu=True, l2_head=h)
                for x, conv, tail, h in zip(xs, m.convs, tails, heads)]
        return [y for y, _ in outs], [t for _, t in outs]

    def decode_slots(self, m: "KimiDeltaAttention", T: int) -> KDASlots | None:
        """The storage a one-token step of every row writes in place (a StaticCache's), else None."""
        if T != 1 or self.doc_ids is not None or self.cache is None:
            return None
        return self.cache.kda_slots(m.layer_idx)

    def core(self, m: "KimiDeltaAttention", q, k, v, f, beta_logits, tails) -> torch.Tensor:
        B, T = q.shape[:2]
        params = (m.A_log, m.dt_bias, m.lower_bound)
        if self.doc_ids is not None:  # packed rows: one flat row of documents
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
            o, _ = kda_core(*map(flat, (q, k, v, f, beta_logits)), *params,
                            cu_seqlens=doc_ids_to_cu_seqlens(self.doc_ids), qk_normalized=self.qk_normalized)
            return o.view(B, T, *o.shape[2:])
        cache = self.cache
        st = cache.kda_state(m.layer_idx) if cache is not None else None
        decode = cache is not None and T == 1
        # a StaticCache's buffers are written in place anyway: the decode step may write the state straight there
        o, state = kda_core(q, k, v, f, beta_logits, *params, initial_state=st.state if st is not None else None,
                            output_final_state=cache is not None, recurrent=decode,
                            state_in_place=decode and isinstance(cache, StaticCache), qk_normalized=self.qk_normalized)
        if cache is not None:
            cache.set_kda_state(m.layer_idx, KDAState(state, *tails))
        return o


class VarlenLayout:
    """S sequences flattened into one row [1, N] by a BatchCacheView, each continuing from its own state.
    Decodes take the recurrent step as one batch, prefill chunks the chunked form over cu_seqlens. Shapes and
    rows come from the view's host layout, so nothing is read back from the device."""

    def __init__(self, view: BatchCacheView):
        self.view = view

    def short_convs(self, m: "KimiDeltaAttention", xs: list[torch.Tensor]):
        view, N, W = self.view, xs[0].shape[1], m.q_conv1d.weight.shape[-1]
        st = view.kda_state(m.layer_idx)
        # q, k and v as one depthwise conv over their channels side by side: one gather of the windows and one of
        # the new tails for the three (each gather, cat and cast a launch in an eager step), the same sums
        S, C = st.conv_q.shape[0], xs[0].shape[-1]
        # (the weights stacked once, not per call; x's three parts are adjacent columns of one GEMM: a view)
        tails = joined_columns([st.conv_q, st.conv_k, st.conv_v])  # (a view where they sit side by side: the pool)
        x = joined_columns(xs)[0]
        if use_triton(x, "_conv_varlen_triton"):  # one kernel: the convs, SiLU and split; the new tails
            seg = view.shared("token_seq", lambda: torch.repeat_interleave(
                torch.arange(S, device=x.device, dtype=torch.int32), view.cu_seqlens.diff(), output_size=N))
            y, tail = triton_module("_conv_varlen_triton").short_convs_varlen(
                x, m.conv_weights.current(), tails, view.cu_seqlens, seg)
        else:
            index = view.shared(("short_conv", W), lambda: short_conv_varlen_index(view.cu_seqlens, N, W))
            y, tail = short_conv_varlen(x, m.conv_weights.current(), tails, index)
            y = F.silu(y.view(N, 3, C).transpose(0, 1).contiguous(), inplace=True)  # [3, N, C]: each a dense block
        tail = tail.view(S, W - 1, 3, C)
        return [y[i][None] for i in range(3)], [tail[:, :, i] for i in range(3)]

    def decode_slots(self, m: "KimiDeltaAttention", T: int) -> KDASlots | None:
        """The pool's slots when every sequence of the step decodes one token (token s is sequence s)."""
        return None if self.view.prefill_rows else self.view.kda_slots(m.layer_idx)

    def core(self, m: "KimiDeltaAttention", q, k, v, f, beta_logits, tails) -> torch.Tensor:
        view, params = self.view, (m.A_log, m.dt_bias, m.lower_bound)
        st = view.kda_state(m.layer_idx)
        feats = [t[0] for t in (q, k, v, f, beta_logits)]  # [N, ...]
        # Decodes and prefill chunks partition the sequences and the tokens: together they fill o and state.
        o = feats[2].new_empty(feats[2].shape)
        state = torch.empty_like(st.state)
        if view.decode_rows:  # a batch of single steps: [n, 1, ...]
            rows, t = view.decode_rows_t, view.decode_tokens_t
            od, sd = kda_core(*(x[t, None] for x in feats), *params, initial_state=st.state[rows],
                              output_final_state=True, recurrent=True)
            o[t] = od[:, 0].to(o.dtype)
            state[rows] = sd.to(state.dtype)
        if view.prefill_rows:  # one packed row of chunks
            # consecutive rows (a prefill-only step, or decodes all before or after): slices, not gathers
            rows, t = view.prefill_span or (view.prefill_rows_t, view.prefill_tokens_t)
            op, sp = kda_core(*(x[None, t] for x in feats), *params, initial_state=st.state[rows],
                              output_final_state=True, cu_seqlens=view.prefill_cu_seqlens,
                              cu_seqlens_cpu=view.prefill_cu_seqlens_cpu, plan=view.prefill_plan)
            if not view.decode_rows:  # the chunks are the whole step: their outputs are the step's, no copies
                o, state = op[0].to(o.dtype), sp.to(state.dtype)
            else:
                o[t] = op[0].to(o.dtype)
                state[rows] = sp.to(state.dtype)
        view.set_kda_state(m.layer_idx, KDAState(state, *tails))
        return o[None]


def kda_layout(cache, doc_ids: torch.Tensor | None):
    """The layout of one forward: a supplied one (anything with `short_convs` and `core`), the serving view's,
    or dense rows."""
    if isinstance(cache, BatchCacheView):
        return VarlenLayout(cache)
    if hasattr(cache, "short_convs") and hasattr(cache, "core"):
        return cache
    return DenseLayout(cache, doc_ids)


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
        self.f_b_proj = DecodeLinear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_norm.weight.data = self.o_norm.weight.data.float()
        self.o_proj = DecodeLinear(H * K, D, bias=False)  # (decode: k3.ops.gemv)
        # the six projections that read x, one GEMM at inference (the parameters keep their released names)
        self.in_proj = FusedLinears(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_proj)
        # the three short convs' weights side by side, as the serving layout runs them (one depthwise conv)
        self.conv_weights = StackedWeights(self.q_conv1d, self.k_conv1d, self.v_conv1d)

    @property
    def convs(self) -> tuple[ShortConv, ShortConv, ShortConv]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (already normalised). `cache`: None, a K3Cache/StaticCache (state read and written in
        place), a BatchCacheView (serving), or a layout object (context parallelism); see `kda_layout`."""
        layout = kda_layout(cache, doc_ids)
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        xq, xk, xv, fa, beta_logits, gate = self.in_proj(x)
        o = self.fused_decode(layout, T, (xq, xk, xv, fa, beta_logits, gate))
        if o is not None:  # the whole step between the projections in one kernel
            return self.o_proj(o.view(B, T, H * K).to(x.dtype))
        convs, tails = layout.short_convs(self, [xq, xk, xv])  # SiLU(conv(x)), new tails
        q, k, v = (c.view(B, T, H, K) for c in convs)
        f = self.f_b_proj(fa).view(B, T, H, K)
        o = layout.core(self, q, k, v, f, beta_logits, tails)  # [B, T, H, V]
        return self.o_proj(self.output_gate(o, gate.view(B, T, H, K)).reshape(B, T, H * K).to(x.dtype))

    def fused_decode(self, layout, T: int, feats) -> torch.Tensor | None:
        """A decode step over in-place storage (`layout.decode_slots`) as one kernel where k3.ops.kda_decode's
        selector takes it: o_norm(o) ⊙ σ(gate) [rows, H·V], the tails and states written; None otherwise."""
        find = getattr(layout, "decode_slots", None)  # (a supplied layout may have none)
        store = find(self, T) if find is not None else None
        if store is None:
            return None
        rows = [t.reshape(-1, t.shape[-1]) for t in feats]  # [B, 1, C] or [1, N, C] views → [rows, C]
        weights = DecodeWeights(self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight,
                                self.f_b_proj.weight, self.A_log, self.dt_bias, self.o_norm.weight,
                                self.lower_bound, self.o_norm.eps)
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (*rows, weights.conv_q, weights.conv_k, weights.conv_v, weights.f_b,
                                      weights.A_log, weights.dt_bias, weights.norm_weight))
        if not use_fused_decode(rows[0], store.state, (self.head_dim, self.head_dim),
                                weights.conv_q.shape[-1], needs_grad):
            return None
        return kda_decode_step(*rows, weights, store.state, store.conv_q, store.conv_k, store.conv_v, store.slots)

    def output_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`o_norm(o) ⊙ sigmoid(gate)` per head; fla's fused gated RMSNorm where the core ran on fla (not in a
        compiled training region: there inductor fuses the plain norm and gate)."""
        if not torch.compiler.is_compiling() and select_backend(o) == "fla":
            return fla_output_gate(o, gate, self.o_norm.weight, self.o_norm.eps)
        return self.o_norm(o) * torch.sigmoid(gate.to(o.dtype))
