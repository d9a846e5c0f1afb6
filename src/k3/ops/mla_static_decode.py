"""MLA's absorbed decode over a StaticCache: the new token written into the cache, then every head's attention
over the cached tokens, from the absorbed queries to the context (SPEC §3.3; W_kvb's two halves stay outside).

Eagerly this is ~18 small kernels a layer and step (the cache write's arange, index_copy_s and length sums, the
two score products and their sum, the mask's aranges and compare, scale, masked_fill, softmax, the context
product). On CUDA it is one Triton kernel (k3.ops._mla_static_decode_triton; on by default since timed on an
H200 in session 13), chosen inside torch.compile too, where it
is the custom op k3::mla_static_decode. `static_decode_attention_reference` is the same step in plain PyTorch
and never dispatches.

Shapes, one new token per row: q_lat [B, H, R] (q_nope · W_uk) and q_rope [B, H, E] (last dims contiguous);
latent [B, R] and k_rope [B, E] of the new token (rows may be strided views); the cache's cache_latent
[B, S, R] and cache_k_rope [B, S, E] (contiguous); length: the device scalar of tokens already cached, where
the new token goes. Returns the context [B, H, R] in the cache's dtype. With `norm_weight` [R] the new latent
comes before its RMSNorm (MLA's kv_a_layernorm), which the step applies first (in the kernel: no launch of its
own).
"""
from __future__ import annotations

import torch

from k3.ops.norm import rms_norm_reference
from k3.ops.triton_dispatch import ticket_workspace, triton_module, use_triton_op

KERNELS = "_mla_static_decode_triton"


def static_decode_attention_reference(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length,
                                      scale: float, norm_weight: torch.Tensor | None = None,
                                      norm_eps: float = 0.0) -> torch.Tensor:
    """The step as the model's unfused path does it (kv_a_layernorm when norm_weight is given,
    StaticCache.mla_append, then MultiHeadLatentAttention.absorbed_attention's scores, mask and softmax): fp32
    softmax (fp64 stays fp64), the probabilities rounded to the cache's dtype before the context product."""
    if norm_weight is not None:
        latent = rms_norm_reference(latent, norm_weight, norm_eps)
    S = cache_latent.shape[1]
    pos = length.reshape(1)
    cache_latent.index_copy_(1, pos, latent[:, None].to(cache_latent.dtype))
    cache_k_rope.index_copy_(1, pos, k_rope[:, None].to(cache_k_rope.dtype))
    scores = (torch.einsum("bhr,bsr->bhs", q_lat, cache_latent)
              + torch.einsum("bhe,bse->bhs", q_rope, cache_k_rope))
    scores = scores.float() if scores.dtype != torch.float64 else scores
    mask = torch.arange(S, device=q_lat.device) <= pos  # [S]
    attn = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1).to(cache_latent.dtype)
    return torch.einsum("bhs,bsr->bhr", attn, cache_latent)


def use_static_decode_kernel(q_lat: torch.Tensor, cache_latent: torch.Tensor, needs_grad: bool) -> bool:
    """Whether the step takes the kernel: inference, CUDA tensors the kernel reads as they are, switched on
    (k3.ops.triton_dispatch.use_triton_op: inside torch.compile too)."""
    return (not needs_grad and q_lat.dtype == cache_latent.dtype and cache_latent.is_contiguous()
            and use_triton_op(q_lat, KERNELS))


def static_decode_attention(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length,
                            scale: float, norm_weight: torch.Tensor | None = None,
                            norm_eps: float = 0.0) -> torch.Tensor:
    """`static_decode_attention_reference` as one kernel launch (k3.ops._mla_static_decode_triton); shapes,
    dtypes and layouts checked first, each error naming the argument."""
    B, H, R = q_lat.shape
    E = q_rope.shape[-1]
    S = cache_latent.shape[1]
    want = {"q_rope": (B, H, E), "latent": (B, R), "k_rope": (B, E), "cache_latent": (B, S, R),
            "cache_k_rope": (B, S, E)}
    got = dict(q_rope=q_rope, latent=latent, k_rope=k_rope, cache_latent=cache_latent, cache_k_rope=cache_k_rope)
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(got[name].shape)}")
    for name, t in dict(cache_latent=cache_latent, cache_k_rope=cache_k_rope).items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    for name, t in dict(q_lat=q_lat, q_rope=q_rope, latent=latent, k_rope=k_rope).items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if q_rope.dtype != q_lat.dtype or cache_k_rope.dtype != cache_latent.dtype or q_lat.dtype != cache_latent.dtype:
        raise ValueError(f"q_lat, q_rope and the cache must share one dtype, got {q_lat.dtype}, {q_rope.dtype}, "
                         f"{cache_latent.dtype}, {cache_k_rope.dtype}")
    if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"length must be one integer on the device, got {length.dtype} {list(length.shape)}")
    if norm_weight is not None and (tuple(norm_weight.shape) != (R,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be a contiguous [{R}], got {list(norm_weight.shape)} "
                         f"strides {norm_weight.stride()}")
    work = ticket_workspace(B * H, q_lat.device)  # one per (row, head block): B·H is enough for any block
    return triton_module(KERNELS).static_decode_attention(q_lat, q_rope, latent, k_rope, cache_latent,
                                                          cache_k_rope, length, scale, work, norm_weight, norm_eps)
