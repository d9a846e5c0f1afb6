"""Causal softmax attention (SDPA) with optional packed-document masking."""
import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention, softmax in fp32 (SDPA's own math path).

    q, k: [B, T, H, D]; v: [B, T, H, V]; doc_ids: [B, T] (tokens only see their own document).
    Returns [B, T, H, V].
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if doc_ids is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        T = q.shape[2]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [B, T, T]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2)
