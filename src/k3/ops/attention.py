"""Causal softmax attention (SDPA) with optional packed-document masking."""
import torch
import torch.nn.functional as F

from k3.ops.lazy_dynamo import assume_constant_result


@assume_constant_result  # a fact of the device: compiled regions take it as a constant
def sdpa_runs_cudnn(device_index: int | None) -> bool:
    """Whether SDPA runs cuDNN's attention on this GPU (Hopper and later, unless switched off): it takes MLA's
    192/128 head split as it is, so the causal call skips the pad to FlashAttention's one head dim: a third less P.V
    and no copies (H100, torch 2.11, 12 heads, forward + backward: 3.9 ms against 6.2 padded at 8 x 4096, 14.3
    against 23.2 at 2 x 16384). A torch that chose otherwise fails tests/test_gpu.py's check of its choice."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(index) >= (9, 0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention, softmax in fp32 (SDPA's own math path).

    q: [B, T, H, D]; k: [B, S, H, D]; v: [B, S, H, V] with S >= T: the queries are the last T positions
    (bottom-right causal, a prefill chunk over its cache). doc_ids: [B, T] (tokens only see their own
    document; needs S == T). Returns [B, T, H, V].
    """
    T, S = q.shape[1], k.shape[1]
    if S < T or (doc_ids is not None and S != T):
        raise ValueError(f"need S >= T keys (S == T with doc_ids), got T={T}, S={S}")
    if q.is_cuda and v.shape[-1] < q.shape[-1] and not (
            S == T and doc_ids is None and sdpa_runs_cudnn(q.device.index)):
        # FlashAttention wants one head dim for q, k and v; zero columns of v leave the real ones unchanged,
        # and flash beats the memory-efficient kernel SDPA would otherwise pick for MLA's 192/128 split.
        o = causal_attention(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), scale, doc_ids)
        return o[..., :v.shape[-1]]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if S != T:  # the bias object keeps SDPA on its fused kernels instead of materialising a [T, S] mask
        from torch.nn.attention.bias import causal_lower_right  # (here: importing it imports Dynamo)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scale)
    elif doc_ids is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [B, T, T]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return o.transpose(1, 2)
