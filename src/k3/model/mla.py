"""Gated MLA without positional encoding (SPEC §3.3): expanded form for training, absorbed form with a cache.

One forward: features (q, normalised latent, k_extra, gate) → attention over the layout's context → gated
output. The layout says where the context lives: `DenseLayout` (no cache, packed documents, or a
K3Cache/StaticCache), `VarlenLayout` (the serving engine's paged pool through a BatchCacheView), or one that
k3.parallel.context_parallel supplies as the `cache` argument (anything with `attend`)."""
import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import BatchCacheView, StaticCache
from k3.model.norm import RMSNorm
from k3.ops.attention import causal_attention
from k3.ops.fused_linear import DerivedWeight, FusedLinears
from k3.ops.gemv import DecodeLinear, linear, use_gemv
from k3.ops.mla_keys import mla_keys
from k3.ops.mla_static_decode import static_decode_attention, use_static_decode_kernel
from k3.ops.sigmoid_gate import sigmoid_gate
from k3.ops.triton_dispatch import triton_module, use_triton
from k3.ops.varlen_attention import document_attention, packed_documents, packs_documents, varlen_causal_attention

# SPEC §3.3 ⚠: the reference uses 1e-6 for q_a_layernorm / kv_a_layernorm (one port uses 1e-5).
LORA_NORM_EPS = 1e-6



class AbsorbedQueryWeight(DerivedWeight):
    """q_b_proj with W_UK (kv_b_proj's key rows) folded in, head by head: [H·(kv_rank+rope), q_lora_rank], each
    head's rows W_UKᵀ·W_q,nope (its latent query) then W_q,rope, made in fp32 and kept in the weights' dtype.
    At one decode token that GEMM replaces q_b's and the per-head q_nope·W_UK product after it: one launch fewer
    for 0.2M more weight elements read (small: 1.47M against 0.88M + 0.39M)."""

    def __init__(self, q_b_proj: nn.Module, kv_b_proj: nn.Module, nope: int, rope: int, kv_rank: int):
        def make(w_q: torch.Tensor, w_kv: torch.Tensor) -> torch.Tensor:
            # the heads the weights hold now: tensor parallelism leaves a rank a slice of them
            heads = w_q.shape[0] // (nope + rope)
            w_q = w_q.view(heads, nope + rope, -1)
            w_uk = w_kv.view(heads, -1, kv_rank)[:, :nope]
            acc = torch.promote_types(w_q.dtype, torch.float32)  # (bf16 weights: the product summed in fp32)
            lat = torch.einsum("hnr,hnc->hrc", w_uk.to(acc), w_q[:, :nope].to(acc)).to(w_q.dtype)
            return torch.cat([lat, w_q[:, nope:]], dim=1).reshape(heads * (kv_rank + rope), w_q.shape[-1])
        super().__init__(make, q_b_proj, kv_b_proj)


class DenseLayout:
    """Rows [B, T]: the expanded form over themselves (packed documents when doc_ids), or after a cache's
    context: the absorbed form for one new token, the expanded form for a prefill chunk."""

    def __init__(self, cache=None, doc_ids: torch.Tensor | None = None):
        self.cache, self.doc_ids = cache, doc_ids

    def attend(self, m: "MultiHeadLatentAttention", q, latent, k_extra, latent_norm: nn.Module | None = None):
        """latent_norm: an RMSNorm the latent has not been through yet (the StaticCache kernel applies it)."""
        T = q.shape[1]
        if latent_norm is not None:
            latent = latent_norm(latent)
        if self.cache is None:
            return m.expanded_attention(q, latent, k_extra, self.doc_ids)
        lat, kx, kv_len = self.cache.mla_append(m.layer_idx, latent, k_extra)
        if T == 1:  # decode: W_kvb folded into q and the output, no per-token K/V expansion
            return m.absorbed_attention(q, lat, kx, kv_len=kv_len)
        S = self.cache.seq_len + T  # prefill chunk: expand the cached latents once, SDPA bottom-right causal
        return m.expanded_attention(q, lat[:, :S], kx[:, :S])

    def static_decode(self, m: "MultiHeadLatentAttention", q_a, latent, k_extra,
                      latent_norm: nn.Module | None = None) -> torch.Tensor | None:
        """`absorbed_attention` of one new token over a StaticCache from q_a (the q_a norm's input), with the
        latent's norm (when given), the cache write, scores, mask, softmax and context in one kernel
        (k3.ops.mla_static_decode), where its selector takes it; else None (the caller computes q and attends).
        With the kept absorbed query weight on (`MultiHeadLatentAttention.absorbed_q`), q_b and W_UK are one
        GEMM: q_lat and q's rope part come out of it, no per-head product after it."""
        cache, H = self.cache, m.num_heads
        if not (q_a.shape[1] == 1 and isinstance(cache, StaticCache)):
            return None
        st = cache.layers[m.layer_idx]
        w = m.kv_b_proj.weight
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_a, latent, k_extra, w))
        if not use_static_decode_kernel(q_a, st.latent, needs_grad):
            return None
        # (as StaticCache.mla_append: not while compiling, where the host length would be a guard)
        if not torch.compiler.is_compiling() and cache.seq_len + 1 > cache.max_len:
            raise ValueError(f"StaticCache holds {cache.max_len} tokens; {cache.seq_len} cached + 1 new do not fit")
        w = w.view(H, m.nope + m.v_dim, m.kv_rank)
        if m.absorbed_q.weight is not None:
            q = linear(q_a[:, 0], m.absorbed_q.current(), norm_weight=m.q_a_layernorm.weight,
                       norm_eps=m.q_a_layernorm.eps).view(-1, H, m.kv_rank + m.rope)
            q_lat, q_extra = q.split([m.kv_rank, m.rope], dim=-1)
        else:
            q = m.queries(q_a)
            q_nope, q_extra = q[:, 0].split([m.nope, m.rope], dim=-1)
            q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w[:, :m.nope])
        norm_weight, norm_eps = (None, 0.0) if latent_norm is None else (latent_norm.weight, latent_norm.eps)
        ctx = static_decode_attention(q_lat, q_extra, latent[:, 0], k_extra[:, 0], st.latent, st.k_extra,
                                      cache.length, m.scale, norm_weight, norm_eps)
        return torch.einsum("bhr,hvr->bhv", ctx, w[:, m.nope:])[:, None]


class VarlenLayout:
    """S sequences flattened into one row [1, N] by a BatchCacheView. Decodes attend as one batch (straight
    from the paged pool with k3's Triton kernel where enabled), the prefill chunks as one packed varlen call over
    their contexts (no padding); rows and lengths come from the view's host layout, so nothing is read back from
    the device."""

    def __init__(self, view: BatchCacheView):
        self.view = view

    def attend(self, m: "MultiHeadLatentAttention", q, latent, k_extra) -> torch.Tensor:
        view = self.view
        view.mla_append(m.layer_idx, latent[0], k_extra[0])
        o = q.new_empty(q.shape[1], m.num_heads, m.v_dim)
        if view.decode_rows:
            t, rows = view.decode_tokens_t, view.decode_rows_t
            paged = view.mla_paged(m.layer_idx, rows) if use_triton(q, "_mla_decode_triton") else None
            if paged is not None:
                o[t] = m.paged_absorbed_attention(q[0, t], *paged, max_len=view.decode_max_len)
            else:
                lat, kx, kv_len = view.mla_context(m.layer_idx, rows, view.decode_max_len)
                o[t] = m.absorbed_attention(q[0, t, None], lat, kx, kv_len=kv_len)[:, 0]
        if view.prefill_rows:
            # every prefill row at once: one gather of their contexts, one kv_b_proj GEMM, one varlen attention
            t = view.prefill_span[1] if view.prefill_span is not None else view.prefill_tokens_t
            k, v = m.expand_kv(*view.mla_prefill_context(m.layer_idx))
            op = varlen_causal_attention(q[0, t], k, v, view.prefill_segments, m.scale)
            if not view.decode_rows:  # the chunks are the whole step: no copy into o
                return op[None]
            o[t] = op
        return o[None]


def mla_layout(cache, doc_ids: torch.Tensor | None):
    """The layout of one forward: a supplied one (anything with `attend`), the serving view's, or dense rows."""
    if isinstance(cache, BatchCacheView):
        return VarlenLayout(cache)
    if hasattr(cache, "attend"):
        return cache
    return DenseLayout(cache, doc_ids)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim ** -0.5
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LORA_NORM_EPS)
        self.q_b_proj = DecodeLinear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = DecodeLinear(H * self.v_dim, D, bias=False)  # (decode: k3.ops.gemv)
        # the three projections that read x, one GEMM at inference (the parameters keep their released names)
        self.in_proj = FusedLinears(self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj)
        # decode over a StaticCache: q_b and W_UK as one kept product (switched on by fuse_projections)
        self.absorbed_q = AbsorbedQueryWeight(self.q_b_proj, self.kv_b_proj, self.nope, self.rope, self.kv_rank)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: [B, T, D] (already normalised); `cache` as in `mla_layout`."""
        q_a, kv_a, gate = self.in_proj(x)
        latent, k_extra = kv_a.split([self.kv_rank, self.rope], dim=-1)
        layout = mla_layout(cache, doc_ids)
        if isinstance(layout, DenseLayout):  # (its StaticCache decode kernel takes the kv norm with it)
            o = layout.static_decode(self, q_a, latent, k_extra, latent_norm=self.kv_a_layernorm)
            if o is None:
                o = layout.attend(self, self.queries(q_a), latent, k_extra, latent_norm=self.kv_a_layernorm)
        else:
            o = layout.attend(self, self.queries(q_a), self.kv_a_layernorm(latent), k_extra)
        return self.gated_output(o, gate)

    def queries(self, q_a: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, nope+rope] = q_b_proj(q_a_layernorm(q_a)) (the norm in q_b's GEMV kernel where decode takes
        it: k3.ops.gemv)."""
        B, T, _ = q_a.shape
        return self.q_b_proj(q_a, norm=self.q_a_layernorm).view(B, T, self.num_heads, self.nope + self.rope)

    def gated_output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o_proj(o ⊙ σ(gate)) over the heads (o [..., H, v_dim], gate [..., H·v_dim]): the gate in o_proj's GEMV
        prologue where decode takes it (k3.ops.gemv: one launch for the three ops), k3.ops.sigmoid_gate otherwise
        (a replaced o_proj, tensor parallelism's, gets the gated input)."""
        rows = o.reshape(gate.shape)  # (a copy where the heads do not merge: made once, for either path)
        if isinstance(self.o_proj, DecodeLinear) and use_gemv(rows, self.o_proj.weight, self.o_proj.bias,
                                                              out_gate=gate):
            return self.o_proj(rows, out_gate=gate)
        return self.o_proj(sigmoid_gate(rows.view(o.shape), gate))

    def expanded_attention(self, q: torch.Tensor, latent: torch.Tensor, k_extra: torch.Tensor,
                           doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal SDPA of the T newest queries q [B, T, H, nope+rope] over S >= T latents [B, S, R] with
        k_extra [B, S, rope]: query t sits at position S−T+t. Returns [B, T, H, v_dim]."""
        k, v = self.expand_kv(latent, k_extra)
        if doc_ids is not None and packs_documents(q, k, v):  # each document a segment, no [B, T, T] mask
            packing = packed_documents(doc_ids, q.device)
            if not packing.whole_rows:
                return document_attention(q, packing.pack_keys(k), packing.pack_keys(v), self.scale, packing)
            doc_ids = None  # one document a row: the causal kernel, no mask
        return causal_attention(q, k, v, self.scale, doc_ids)

    def expand_kv(self, latent: torch.Tensor, k_extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [..., S, H, nope+rope] and values [..., S, H, v_dim] of latents [..., S, R] with k_extra
        [..., S, rope] (shared by the heads)."""
        return mla_keys(self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.nope + self.v_dim)), k_extra,
                        self.nope)

    def paged_absorbed_attention(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, kv_len: torch.Tensor,
                                 max_len: int) -> torch.Tensor:
        """`absorbed_attention` of one new token per row (q [n, H, nope+rope]) over a paged pool (see
        BatchCacheView.mla_paged), by k3.ops._mla_decode_triton. Returns [n, H, v_dim]."""
        H = self.num_heads
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_rank)
        q_nope, q_extra = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("shn,hnr->shr", q_nope, w[:, :self.nope])
        ctx = triton_module("_mla_decode_triton").paged_mla_decode(q_lat, q_extra, kv, tables, kv_len, max_len,
                                                                    self.scale)
        return torch.einsum("shr,hvr->shv", ctx.to(kv.dtype), w[:, self.nope:])

    def absorbed_attention(self, q: torch.Tensor, latent: torch.Tensor, k_extra: torch.Tensor,
                           kv_len: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the T newest queries over S cached latents, with W_kvb folded into q and the output.

        q: [B, T, H, nope+rope]; latent: [B, S, R]; k_extra: [B, S, rope]. Query t sits at position S−T+t,
        or at kv_len[b]−T+t when kv_len [B] gives each row's true length (rows padded to S).
        """
        B, T, H, _ = q.shape
        S = latent.shape[1]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_nope, q_extra = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
        scores = torch.einsum("bthr,bsr->bhts", q_lat, latent) + torch.einsum("bthe,bse->bhts", q_extra, k_extra)
        scores = scores.float() if scores.dtype != torch.float64 else scores
        if kv_len is None:
            pos = torch.arange(S - T, S, device=q.device)
            mask = torch.arange(S, device=q.device)[None, :] <= pos[:, None]  # [T, S]
        else:
            pos = kv_len[:, None] - T + torch.arange(T, device=q.device)  # [B, T]
            mask = (torch.arange(S, device=q.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        attn = torch.softmax((scores * self.scale).masked_fill(~mask, float("-inf")), dim=-1).to(latent.dtype)
        ctx = torch.einsum("bhts,bsr->bthr", attn, latent)
        return torch.einsum("bthr,hvr->bthv", ctx, w_uv)
