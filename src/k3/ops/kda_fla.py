"""KDA on CUDA through flash-linear-attention (fla >= 0.6.0): the GPU dispatch beside k3.ops.kda's references.

fla is imported lazily, so importing this module needs neither triton nor fla; `fla_usable(x)` says whether a
tensor can take the fla path (CUDA, bf16/fp16, or fp32 where TF32 is allowed, fla importable, K <= 256, not
disabled by K3_NO_FLA=1, see k3.envs). k3.ops.kda_core decides when the model takes it.

State layout: fla's default, K-first `[N, H, K, V]` in float32 (`state_v_first=False`), the same as the
references'. fla 0.5.x had a causality bug in the safe-gate path, so older versions are refused.

Three entry points:
- `fla_kda_chunk`: same contract as `kda_chunk` (q, k already L2-normalised, g a log-decay). Autograd works.
- `fla_kda_recurrent`: same contract as `kda_recurrent`; fla's fused recurrent kernel (forward only) when no
  gradient is needed, else the chunked kernel (same function).
- `fla_kda_gated`: the K3 layer's whole inner op with the gate, the q/k L2 norm and the beta sigmoid computed
  in the kernel (`use_gate_in_kernel`, `lower_bound`, `safe_gate`, `use_qk_l2norm_in_kernel`,
  `use_beta_sigmoid_in_kernel`), i.e. SPEC §3.2's g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).
  Without gradients (and unless K3_FLA_LEAN=0), its chunked form (and `fla_output_gate`) take k3.ops.kda_fla_lean:
  the same kernels without the training entry's per-call host work.
Unless K3_KDA_BWD=fla, a chunked call's backward runs k3's kernels for the stages K3_KDA_BWD names (default wy:
the WY/state stage) where k3.ops.kda_fla_backend covers the call.
Unless K3_FLA_KEEP_FORWARD=0, a chunked call that will be differentiated keeps fla's forward intermediates for its
backward (`disable_recompute`), which otherwise recomputes them.
"""
from __future__ import annotations

import functools

import torch

from k3 import envs
from k3.ops import tuning
from k3.ops.kda_fla_lean import dense_as
from k3.ops.triton_dispatch import on_device

__all__ = ["fla_available", "fla_usable", "fla_kda_chunk", "fla_kda_recurrent", "fla_kda_gated", "fla_output_gate",
           "fp32_allowed", "safe_gate_ok", "SAFE_GATE_BOUND", "MIN_FLA_VERSION"]

MIN_FLA_VERSION = (0, 6, 0)
SAFE_GATE_BOUND = -5.0  # fla's safe-gate kernels (M=16 tensor cores) need every gate >= this; lower ones overflow


def safe_gate_ok(lower_bound: float | None) -> bool:
    """Whether gates known to lie in [lower_bound, 0) may take fla's safe-gate kernels (None: no bound known)."""
    return lower_bound is not None and SAFE_GATE_BOUND <= float(lower_bound) < 0.0


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """True when fla >= 0.6.0 and its KDA ops import (never on a machine without triton)."""
    try:
        import fla  # noqa: F401
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401
    except Exception:  # ImportError, or triton failing to initialise without a GPU
        return False
    version = getattr(fla, "__version__", "0")
    return _version_tuple(version) >= MIN_FLA_VERSION


def fp32_allowed() -> bool:
    """Whether fp32 tensors may take fla: only where the user allowed TF32 for fp32 matmuls (e.g.
    `torch.backends.cuda.matmul.fp32_precision = "tf32"`). fla's CUDA kernels leave `tl.dot` at its default,
    TF32 on Ampere and later (~1e-3 relative), while torch's fp32 default is IEEE: an fp32 model keeps fp32
    accuracy on the references unless it asked for TF32."""
    try:  # the new API reads whichever API set it; the legacy reads raise after a new-API set
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except AttributeError:
        return bool(torch.backends.cuda.matmul.allow_tf32)


def fla_usable(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether x (a q-like tensor) can take the fla path. CPU tensors never do."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in _DTYPES):
        return False
    if x.dtype == torch.float32 and not fp32_allowed():
        return False
    if envs.current().no_fla:
        return False
    if (head_dim if head_dim is not None else x.shape[-1]) > 256:
        return False
    return fla_available()


def _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens):
    """Shape checks only (no device sync, no pass over the data): the fast path must stay fast."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must match q's shape {list(q.shape)}, got {list(k.shape)} and {list(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with [B, T, H]={[B, T, H]}, got {list(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]={[B, T, H]}, got {list(beta.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens requires packed input with B == 1, got B={B}")
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, H, K, v.shape[3]):
        raise ValueError(f"initial_state must be [N, H, K, V]={[n, H, K, v.shape[3]]}, got {list(initial_state.shape)}")


def _cu(cu_seqlens, device, cu_seqlens_cpu=None):
    """fla wants int64 cu_seqlens on the device; a CPU copy spares it a sync when it plans the chunks. A given
    host copy is passed on as it is: fla caches its chunk plan by the tensors' identity, so one host tensor
    for a whole step plans once, not once per layer."""
    if cu_seqlens is None:
        return None, None
    if cu_seqlens_cpu is None and not cu_seqlens.is_cuda:
        cu_seqlens_cpu = cu_seqlens
    cpu = None if cu_seqlens_cpu is None else cu_seqlens_cpu.to("cpu", torch.int64)
    return cu_seqlens.to(device=device, dtype=torch.int64), cpu


def _pin_choices(x: torch.Tensor) -> None:
    """Before fla's first kernel on x's GPU: pin the shipped autotune choices (k3.ops.tuning; once per device).
    Not while torch.compile traces (the eager warm-up before it has pinned them)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        tuning.pin_for_device(x.device)


def lean_enabled() -> bool:
    """Whether inference takes k3.ops.kda_fla_lean: not switched off (K3_FLA_LEAN=0), fla of the series it calls, and
    not inside torch.compile (fla's public entries keep their stages out of the graph; the lean calls do not)."""
    if not envs.current().fla_lean or torch.compiler.is_compiling():
        return False
    from k3.ops import kda_fla_lean

    return kda_fla_lean.lean_supported()


def _keep_forward(needs_grad: bool) -> bool:
    """fla's disable_recompute for a chunk_kda call: unless K3_FLA_KEEP_FORWARD=0, a call that will be differentiated
    keeps its forward's intermediates for the backward rather than recomputing them there (memory for time)."""
    return needs_grad and envs.current().fla_keep_forward


def _offer_k3_backward(needs_grad: bool) -> None:
    """Unless K3_KDA_BWD=fla, k3's kernels join fla's backend dispatcher (k3.ops.kda_fla_backend)
    before the first chunked call that will be differentiated; its verifiers keep every call they do not cover
    on fla's."""
    if needs_grad and envs.current().kda_bwd != "fla":
        from k3.ops import kda_fla_backend

        kda_fla_backend.register_with_fla()


def _state(initial_state):
    return None if initial_state is None else initial_state.float().contiguous()


def fla_kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, safe_gate=False, cu_seqlens_cpu=None):
    """`kda_chunk` through fla's chunk_kda. q, k: [B, T, H, K] (L2-normalised); g: [B, T, H, K] log-decay
    <= 0, and >= -5 when safe_gate; v: [B, T, H, V]; beta: [B, T, H] in (0, 1); initial_state: [N, H, K, V]
    fp32 (K-first). cu_seqlens_cpu: cu_seqlens' values on the host, if known (spares fla a read-back).
    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None)."""
    from fla.ops.kda import chunk_kda

    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    _pin_choices(q)
    cu, cu_cpu = _cu(cu_seqlens, q.device, cu_seqlens_cpu)
    # safe_gate (see SAFE_GATE_BOUND): only the caller, who knows the gates' bound, may ask for it
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    _offer_k3_backward(needs_grad)
    o, state = chunk_kda(q, k.to(q.dtype), v.to(q.dtype), g.float(), beta.to(q.dtype), scale=scale,
                         initial_state=_state(initial_state), output_final_state=output_final_state,
                         safe_gate=safe_gate, state_v_first=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                         disable_recompute=_keep_forward(needs_grad))
    return o.to(v.dtype), state


def fla_kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, cu_seqlens_cpu=None):
    """`kda_recurrent` on CUDA: fla's fused recurrent kernel without autograd (decode), else the chunked
    kernel, which computes the same function and has a backward. Layouts as `fla_kda_chunk`."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if needs_grad:  # general gates: the recurrent contract has no bound below
        return fla_kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu)
    from fla.ops.kda import fused_recurrent_kda

    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    _pin_choices(q)
    cu, _ = _cu(cu_seqlens, q.device)
    o, state = fused_recurrent_kda(q, k.to(q.dtype), v.to(q.dtype), g.float(), beta.to(q.dtype), scale=scale,
                                   initial_state=_state(initial_state), output_final_state=output_final_state,
                                   state_v_first=False, cu_seqlens=cu)
    return o.to(v.dtype), state


def fla_kda_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound=-5.0, scale=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, recurrent=None, state_in_place=False,
                  cu_seqlens_cpu=None, plan=None, qk_normalized=False):
    """The K3 mixer's inner op with gate, q/k L2 norm and beta sigmoid fused into fla's kernels.

    q, k: [B, T, H, K] raw (after conv and SiLU, before the L2 norm; with `qk_normalized` after it, and fla's
    kernels skip it); v: [B, T, H, V];
    f: [B, T, H, K] the low-rank gate projection W_fb W_fa x; beta_logits: [B, T, H] (before the sigmoid);
    A_log: [H'] (H' >= H, first H used); dt_bias: [H*K] or [H, K]; lower_bound in [-5, 0).
    recurrent: use the fused recurrent kernel (forward only); default: when T == 1 and no gradient is needed.
    state_in_place: the recurrent kernel writes the final state over initial_state (fp32, contiguous) and
    returns it: a decode step over a preallocated cache then reads and writes each state once, no copy.
    cu_seqlens_cpu: cu_seqlens' values on the host, if known (the chunked kernel plans from it, no read-back).
    plan: the chunked kernel's plan of cu_seqlens made by the caller (k3.ops.kda_fla_lean.ChunkPlan); a CUDA-graph
    plan (`graph`) runs only through the lean entry, the one that takes it.
    Computes kda_recurrent(l2(q), l2(k), v, kda_gate(f, A_log, dt_bias, lower_bound), sigmoid(beta_logits)).
    """
    B, T, H, K = q.shape
    _check_shapes(q, k, v, f, beta_logits, initial_state, cu_seqlens)
    _pin_choices(q)
    if not safe_gate_ok(lower_bound):
        raise ValueError(f"lower_bound must be in [{SAFE_GATE_BOUND}, 0) for fla's safe gate, got {lower_bound!r}")
    A = dense_as(A_log if A_log.shape[0] == H else A_log[:H], torch.float32)
    bias = dense_as(dt_bias if dt_bias.shape == (H * K,) else dt_bias.reshape(H * K), torch.float32)
    cu, cu_cpu = _cu(cu_seqlens, q.device, cu_seqlens_cpu)
    dt, l2 = q.dtype, not qk_normalized
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, f, beta_logits, A_log, dt_bias, initial_state))
    if recurrent is None:
        recurrent = T == 1 and not needs_grad
    if recurrent and needs_grad:
        raise ValueError("fla's fused recurrent kernel has no backward: recurrent=True needs inputs without grad")
    if state_in_place and not (recurrent and initial_state is not None and initial_state.dtype == torch.float32
                               and initial_state.is_contiguous()):
        raise ValueError("state_in_place needs the recurrent kernel and an fp32 contiguous initial_state")
    if state_in_place:  # fla's own in-place entry (what its serving integrations call)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        # contiguous: this entry skips fla's input guard, and its kernel indexes q, k, v, g, beta as dense
        # (the fused projections' outputs are strided views; read as dense they were 5% off on the H200)
        q, k, v, f, beta_logits = (dense_as(t, dt) for t in (q, k, v, f, beta_logits))
        o, state = fused_recurrent_kda_fwd(q, k, v, f, beta_logits, A_log=A,
                                           dt_bias=bias, scale=scale, initial_state=initial_state,
                                           output_final_state=True, inplace_final_state=True,
                                           use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, lower_bound=float(lower_bound),
                                           state_v_first=False, cu_seqlens=cu)
    elif recurrent:
        from fla.ops.kda import fused_recurrent_kda

        o, state = fused_recurrent_kda(q, k.to(dt), v.to(dt), f.to(dt), beta_logits.to(dt), A_log=A,
                                       dt_bias=bias, scale=scale, initial_state=_state(initial_state),
                                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                       lower_bound=float(lower_bound), state_v_first=False, cu_seqlens=cu)
    elif not needs_grad and lean_enabled():  # inference: the lean entry (unless K3_FLA_LEAN=0), same kernels
        from k3.ops import kda_fla_lean

        if plan is None and cu is not None:
            plan = kda_fla_lean.chunk_plan(cu, cu_cpu)
        with on_device(q):
            o, state = kda_fla_lean.chunk_kda_prefill(
                *(dense_as(t, dt) for t in (q, k, v, f, beta_logits)), A, bias, lower_bound, scale=scale,
                initial_state=_state(initial_state), output_final_state=output_final_state, plan=plan,
                qk_normalized=qk_normalized)
    elif plan is not None and plan.graph:
        raise ValueError("a CUDA-graph chunk plan runs through the lean entry only (inference, K3_FLA_LEAN on, fla "
                         "0.6, not recurrent)")
    else:
        from fla.ops.kda import chunk_kda

        _offer_k3_backward(needs_grad)
        o, state = chunk_kda(q, k.to(dt), v.to(dt), f.to(dt), beta_logits.to(dt), scale=scale,
                             initial_state=_state(initial_state), output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=float(lower_bound),
                             state_v_first=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, A_log=A, dt_bias=bias,
                             disable_recompute=_keep_forward(needs_grad))
    return o.to(v.dtype), state


def fla_output_gate(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output gate `rms_norm(o, weight) ⊙ sigmoid(g)` through fla's fused gated RMSNorm: one kernel
    forward and one backward, fp32 inside, o's dtype out (the plain path is a norm, a sigmoid and a multiply,
    each a pass over [B, T, H, K] both ways). o, g: [..., K]; weight: [K] (fp32 in the checkpoint)."""
    _pin_choices(o)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (o, g, weight))) and lean_enabled():
        from k3.ops import kda_fla_lean

        with on_device(o):
            return kda_fla_lean.gated_rms_norm(o, g.to(o.dtype), weight, eps)
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, g.to(o.dtype), weight, None, activation="sigmoid", eps=eps)
