"""k3's KDA chunk-backward kernels offered to fla's backend dispatcher (fla >= 0.6, `fla.backends`).

fla 0.6 routes each stage of its KDA backward through a registry: a backend registered for the operation 'kda'
with a method named like the stage and a `<stage>_verifier` runs the calls its verifier accepts, and fla's own
kernel runs the rest. `register_with_fla()` registers k3's backend once (k3.ops.kda_fla calls it before its first
chunked call when K3_KDA_BWD=k3, see k3.envs); fla is imported only there, i.e. where it imports (a GPU machine).

The stage it takes: `chunk_kda_bwd_wy_dqkg_fused` (k3.ops._kda_bwd_triton), for what k3's training calls
(`wy_dqkg_accepts`): no varlen, no CUDA-graph buffers, K-first states, chunk 64, as many value heads as key heads,
K and V powers of two from 16 to 256, and K3_KDA_BWD=k3 at the call.
"""
from __future__ import annotations

import torch

from k3 import envs

BACKEND_TYPE = "k3"
PRIORITY = 1  # ahead of fla's TileLang backend (5; not installed on our H200); fla's NPU backend (0) is NPU-only
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_registered = False


def _power_of_two(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0


def wy_dqkg_accepts(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False) -> tuple[bool, str | None]:
    """(accepted, reason) for a call of fla's chunk_kda_bwd_wy_dqkg_fused, by the switch, the flags and the shapes
    alone (any device: the GPU check is the backend's). Its arguments are fla's, by the same names."""
    if envs.current().kda_bwd != "k3":
        return False, "K3_KDA_BWD is not 'k3'"
    if cu_seqlens is not None or chunk_indices is not None:
        return False, "varlen calls stay with fla's kernel"
    if use_graph:
        return False, "use_graph (fla's static CUDA-graph buffers) stays with fla's kernel"
    if state_v_first:
        return False, "V-first states stay with fla's kernel"
    if chunk_size != 64:
        return False, f"chunk size {chunk_size}, not 64"
    if k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be [B, T, H, D]"
    B, T, H, K = k.shape
    V = v.shape[-1]
    if v.shape[:3] != (B, T, H):
        return False, f"v {tuple(v.shape)} against k {tuple(k.shape)} (value heads must equal key heads)"
    if not (_power_of_two(K) and _power_of_two(V)):
        return False, f"K {K}, V {V}: powers of two from 16 to 256 only"
    NT = -(-T // chunk_size)
    expected = {"q": (q, k.shape), "g": (g, k.shape), "v_new": (v_new, v.shape), "do": (do, v.shape),
                "dv": (dv, v.shape), "beta": (beta, (B, T, H)), "A": (A, (B, T, H, chunk_size)),
                "h": (h, (B, NT, H, K, V)), "dh": (dh, (B, NT, H, K, V))}
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != tuple(shape):
            return False, f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}"
    tensors = (q, k, v, v_new, g, beta, A, h, do, dh, dv)
    if any(x.dtype not in _FLOATS for x in tensors):
        return False, "dtypes other than bf16, fp16, fp32"
    if len({x.device for x in tensors}) != 1:
        return False, "tensors on several devices"
    return True, None


def register_with_fla() -> None:
    """Register k3's backend for fla's 'kda' operation (once a process)."""
    global _registered
    if _registered:
        return
    from fla.backends import BaseBackend, register

    @register("kda")
    class K3KDABackend(BaseBackend):
        backend_type = BACKEND_TYPE
        priority = PRIORITY

        def chunk_kda_bwd_wy_dqkg_fused_verifier(self, q, *args, **kwargs):
            if not q.is_cuda:
                return False, "not a CUDA tensor"
            return wy_dqkg_accepts(q, *args, **kwargs)

        def chunk_kda_bwd_wy_dqkg_fused(self, q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, **_):
            from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

            return chunk_kda_bwd_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv,
                                         k.shape[-1] ** -0.5 if scale is None else scale)

    _registered = True
