"""k3's KDA chunk-backward kernels offered to fla's backend dispatcher (fla >= 0.6, `fla.backends`).

fla 0.6 routes each stage of its KDA backward through a registry: a backend registered for the operation 'kda'
with a method named like the stage and a `<stage>_verifier` runs the calls its verifier accepts, and fla's own
kernel runs the rest. `register_with_fla()` registers k3's backend once (k3.ops.kda_fla calls it before its first
chunked call unless K3_KDA_BWD=fla, see k3.envs); fla is imported only there, i.e. where it imports (a GPU machine).

The stages it takes (k3.ops._kda_bwd_triton), for what k3's training calls: `chunk_kda_bwd_wy_dqkg_fused`
(`wy_dqkg_accepts`: rows of one sequence or fla's varlen layout, no CUDA-graph buffers, K-first states, chunk 64,
as many value heads as key heads, K and V powers of two from 16 to 256) and `chunk_kda_bwd_intra` (`intra_accepts`:
the same but not varlen, and fla's safe gate (gates in [-5, 0)), which the kernel's fp32 anchoring relies on); each
only while K3_KDA_BWD names it (k3: both; wy; intra) at the call.
"""
from __future__ import annotations

import logging

import torch

from k3 import envs

BACKEND_TYPE = "k3"
PRIORITY = 1  # ahead of fla's TileLang backend (5; not installed on our H200); fla's NPU backend (0) is NPU-only
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_registered = False
_refused = False  # fla.backends did not import once (warned)
_log = logging.getLogger(__name__)


def _power_of_two(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0


def _switched_on(stage: str) -> bool:
    return envs.current().kda_bwd in ("k3", stage)


def _general_refusal(use_graph, chunk_size) -> str | None:
    if use_graph:
        return "use_graph (fla's static CUDA-graph buffers) stays with fla's kernel"
    if chunk_size != 64:
        return f"chunk size {chunk_size}, not 64"
    return None


def _offsets_refusal(T: int, H: int, width: int) -> str | None:
    """The kernels index a row's tiles with int32 offsets (k3.ops._kda_bwd_triton)."""
    if T * H * width >= 2 ** 31:
        return f"T {T} x H {H} x {width} elements a row: past int32 offsets"
    return None


def _varlen_refusal(B: int, cu_seqlens, chunk_indices, device) -> str | None:
    """The kernels read fla's varlen layout as its forward hands it over: one row, the sequences' offsets and each
    chunk's (sequence, chunk within it); chunk_indices is fla's to build (its own kernel builds it when absent)."""
    if cu_seqlens is None or chunk_indices is None:
        return "varlen without both cu_seqlens and chunk_indices stays with fla's kernel"
    if B != 1:
        return f"varlen with {B} rows (fla packs sequences into one)"
    if cu_seqlens.dim() != 1 or chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        return f"cu_seqlens {tuple(cu_seqlens.shape)}, chunk_indices {tuple(chunk_indices.shape)}: not [N+1], [NT, 2]"
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or chunk_indices.dtype not in (torch.int32, torch.int64):
        return f"cu_seqlens {cu_seqlens.dtype}, chunk_indices {chunk_indices.dtype}: not int32 or int64"
    if cu_seqlens.device != device or chunk_indices.device != device:
        return f"cu_seqlens on {cu_seqlens.device}, chunk_indices on {chunk_indices.device}, k on {device}"
    return None


def _shape_refusal(expected: dict, tensors) -> str | None:
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != tuple(shape):
            return f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}"
    if any(x.dtype not in _FLOATS for x in tensors):
        return "dtypes other than bf16, fp16, fp32"
    if len({x.device for x in tensors}) != 1:
        return "tensors on several devices"
    return None


def wy_dqkg_accepts(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, state_v_first=False, cu_seqlens=None,
                    chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False) -> tuple[bool, str | None]:
    """(accepted, reason) for a call of fla's chunk_kda_bwd_wy_dqkg_fused, by the switch, the flags and the shapes
    alone (any device: the GPU check is the backend's). Its arguments are fla's, by the same names."""
    if not _switched_on("wy"):
        return False, "K3_KDA_BWD does not name this stage (k3 or wy)"
    refusal = _general_refusal(use_graph, chunk_size)
    if refusal:
        return False, refusal
    if state_v_first:
        return False, "V-first states stay with fla's kernel"
    if k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be [B, T, H, D]"
    B, T, H, K = k.shape
    V = v.shape[-1]
    if v.shape[:3] != (B, T, H):
        return False, f"v {tuple(v.shape)} against k {tuple(k.shape)} (value heads must equal key heads)"
    if not (_power_of_two(K) and _power_of_two(V)):
        return False, f"K {K}, V {V}: powers of two from 16 to 256 only"
    refusal = _offsets_refusal(T, H, max(K, V, chunk_size))
    if refusal:
        return False, refusal
    if cu_seqlens is not None or chunk_indices is not None:
        refusal = _varlen_refusal(B, cu_seqlens, chunk_indices, k.device)
        if refusal:
            return False, refusal
        NT = chunk_indices.shape[0]
    else:
        NT = -(-T // chunk_size)
    expected = {"q": (q, k.shape), "g": (g, k.shape), "v_new": (v_new, v.shape), "do": (do, v.shape),
                "dv": (dv, v.shape), "beta": (beta, (B, T, H)), "A": (A, (B, T, H, chunk_size)),
                "h": (h, (B, NT, H, K, V)), "dh": (dh, (B, NT, H, K, V))}
    refusal = _shape_refusal(expected, (q, k, v, v_new, g, beta, A, h, do, dh, dv))
    return (False, refusal) if refusal else (True, None)


def intra_accepts(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=None, chunk_indices=None, chunk_size=64,
                  safe_gate=False, lower_bound=None, use_graph=False) -> tuple[bool, str | None]:
    """(accepted, reason) for a call of fla's chunk_kda_bwd_intra, as `wy_dqkg_accepts`. The kernel anchors each
    16-token sub-chunk's decays in fp32, which stays finite only under fla's safe gate (decays >= e^-5 a token)."""
    if not _switched_on("intra"):
        return False, "K3_KDA_BWD does not name this stage (k3 or intra)"
    if cu_seqlens is not None or chunk_indices is not None:
        return False, "varlen calls stay with fla's kernel"
    refusal = _general_refusal(use_graph, chunk_size)
    if refusal:
        return False, refusal
    # fla's backward passes safe_gate alone (no lower_bound): its safe-gate contract is gates >= -5
    if not safe_gate or (lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0):
        return False, f"safe_gate {safe_gate}, lower_bound {lower_bound}: needs fla's safe gate (gates in [-5, 0))"
    if k.dim() != 4:
        return False, "q, k must be [B, T, H, K]"
    B, T, H, K = k.shape
    if not _power_of_two(K):
        return False, f"K {K}: powers of two from 16 to 256 only"
    refusal = _offsets_refusal(T, H, max(K, chunk_size))
    if refusal:
        return False, refusal
    expected = {"q": (q, k.shape), "g": (g, k.shape), "dq": (dq, k.shape), "dk": (dk, k.shape),
                "dg": (dg, k.shape), "beta": (beta, (B, T, H)), "db": (db, (B, T, H)),
                "dAqk": (dAqk, (B, T, H, chunk_size)), "dAkk": (dAkk, (B, T, H, chunk_size))}
    refusal = _shape_refusal(expected, (q, k, g, beta, dAqk, dAkk, dq, dk, db, dg))
    return (False, refusal) if refusal else (True, None)


def register_with_fla() -> None:
    """Register k3's backend for fla's 'kda' operation (once a process). Its methods take fla's keyword
    arguments by name (fla's stages call them so)."""
    global _registered, _refused
    if _registered:
        return
    try:
        from fla.backends import BaseBackend, register
    except ImportError as e:  # an fla without the registry (or a stand-in module): its own kernels run every stage
        if not _refused:
            _log.warning("k3's KDA backward kernels not offered to fla (%s): fla's own run", e)
        _refused = True
        return

    @register("kda")
    class K3KDABackend(BaseBackend):
        backend_type = BACKEND_TYPE
        priority = PRIORITY

        def chunk_kda_bwd_wy_dqkg_fused_verifier(self, q, *args, **kwargs):
            if not q.is_cuda:
                return False, "not a CUDA tensor"
            return wy_dqkg_accepts(q, *args, **kwargs)

        def chunk_kda_bwd_wy_dqkg_fused(self, q, k, v, v_new, g, beta, A, h, do, dh, dv, scale=None, cu_seqlens=None,
                                        chunk_indices=None, **_):
            from k3.ops._kda_bwd_triton import chunk_kda_bwd_wy_dqkg

            return chunk_kda_bwd_wy_dqkg(q, k, v, v_new, g, beta, A, h, do, dh, dv,
                                         k.shape[-1] ** -0.5 if scale is None else scale, cu_seqlens, chunk_indices)

        def chunk_kda_bwd_intra_verifier(self, q, *args, **kwargs):
            if not q.is_cuda:
                return False, "not a CUDA tensor"
            return intra_accepts(q, *args, **kwargs)

        def chunk_kda_bwd_intra(self, q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, **_):
            from k3.ops._kda_bwd_triton import chunk_kda_bwd_intra

            return chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg)

    _registered = True
