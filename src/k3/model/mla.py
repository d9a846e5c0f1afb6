"""Gated MLA without positional encoding (SPEC §3.3): expanded form for training, absorbed form with a cache."""
import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import BatchCacheView
from k3.model.norm import RMSNorm
from k3.ops.attention import causal_attention
from k3.ops.triton_dispatch import triton_module, use_triton

# SPEC §3.3 ⚠: the reference uses 1e-6 for q_a_layernorm / kv_a_layernorm (one port uses 1e-5).
LORA_NORM_EPS = 1e-6


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
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.nope + self.rope)
        latent, k_extra = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if isinstance(cache, BatchCacheView):
            o = self._attend_varlen(q, latent, k_extra, cache)
        elif cache is None:
            o = self.expanded_attention(q, latent, k_extra, doc_ids)
        else:
            lat, kx, kv_len = cache.mla_append(self.layer_idx, latent, k_extra)
            if T == 1:  # decode: W_kvb folded into q and the output, no per-token K/V expansion
                o = self.absorbed_attention(q, lat, kx, kv_len=kv_len)
            else:  # prefill chunk: expand the cached latents once and let SDPA run bottom-right causal
                S = cache.seq_len + T
                o = self.expanded_attention(q, lat[:, :S], kx[:, :S])
        o = o.reshape(B, T, H * self.v_dim) * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def expanded_attention(self, q: torch.Tensor, latent: torch.Tensor, k_extra: torch.Tensor,
                           doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal SDPA of the T newest queries q [B, T, H, nope+rope] over S >= T latents [B, S, R] with
        k_extra [B, S, rope]: query t sits at position S−T+t. Returns [B, T, H, v_dim]."""
        B, S, _ = latent.shape
        H = self.num_heads
        k_nope, v = self.kv_b_proj(latent).view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_extra[:, :, None, :].expand(B, S, H, self.rope)], dim=-1)
        return causal_attention(q, k, v, self.scale, doc_ids)

    def _attend_varlen(self, q: torch.Tensor, latent: torch.Tensor, k_extra: torch.Tensor,
                       cache: BatchCacheView) -> torch.Tensor:
        """q: [1, N, H, nope+rope] of S sequences laid out by the view → o [1, N, H, v_dim]. Decodes attend as
        one batch, each prefill chunk on its own, so padding stays small; rows and lengths come from the view's
        host layout, so nothing is read back from the device."""
        cache.mla_append(self.layer_idx, latent[0], k_extra[0])
        o = q.new_empty(q.shape[1], self.num_heads, self.v_dim)
        if cache.decode_rows:
            t = cache.decode_tokens_t
            rows = cache.decode_rows_t
            paged = cache.mla_paged(self.layer_idx, rows) if use_triton(q, "_mla_decode_triton") else None
            if paged is not None:  # straight from the pool, without gathering each row's context first
                o[t] = self.paged_absorbed_attention(q[0, t], *paged, max_len=cache.decode_max_len)
            else:
                lat, kx, kv_len = cache.mla_context(self.layer_idx, rows, cache.decode_max_len)
                o[t] = self.absorbed_attention(q[0, t, None], lat, kx, kv_len=kv_len)[:, 0]
        for i, r in enumerate(cache.prefill_rows):
            lat, kx, _ = cache.mla_context(self.layer_idx, cache.prefill_rows_t[i:i + 1], cache.kv_lens[r])
            a, b = cache.cu_host[r], cache.cu_host[r + 1]
            o[a:b] = self.expanded_attention(q[:, a:b], lat, kx)[0]
        return o[None]

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
