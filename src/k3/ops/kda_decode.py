"""KDA's decode step at T = 1 over state kept in place: everything between the input projection GEMM and o_proj.

A decode step of a KDA layer is small work split into many kernels (three convs, tail copies, the gate's second
projection, casts, the recurrent step, the gated norm): in a CUDA graph their count, not their bytes, sets the
time. On CUDA the whole step runs as one Triton kernel (k3.ops._kda_decode_triton) that updates the conv tails
and the recurrent state where they live: a StaticCache's buffers (row b is slot b) or the serving pool's slots
(a slot table). `kda_decode_step_reference` is the same step in plain PyTorch (it never dispatches); the
selector `use_fused_decode` picks the kernel on CUDA without gradients, where triton is there and
K3_NO_TRITON does not name `_kda_decode_triton` (k3.envs; inside torch.compile too, where it is one custom op);
`force_fused_decode` pins the choice in tests (True runs the kernel on CPU tensors too, under
TRITON_INTERPRET=1). Elsewhere the layer takes its unfused path.

Inputs, one row per decoding sequence (views of the fused projection's output; columns contiguous):
xq, xk [B, H·K] and xv [B, H·V] before the conv; fa [B, R] (W_fa x); beta_logits [B, H]; gate [B, H·V] (W_g x).
Storage: state [N, H, K, V] fp32, conv tails conv_q, conv_k [N, W−1, H·K] and conv_v [N, W−1, H·V] fp32,
slots [B] int64 (row b's index into N; None: row b is slot b). Returns o_norm(o) ⊙ σ(gate) [B, H·V] in xq's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.ops.kda import kda_gate
from k3.ops.kda_core import forced_backend, log_once
from k3.ops.norm import rms_norm_reference
from k3.ops.triton_dispatch import Forced, call_op, switched_on, triton_module

__all__ = ["DecodeWeights", "kda_decode_step_reference", "use_fused_decode", "force_fused_decode",
           "kda_decode_step"]

KERNELS = "_kda_decode_triton"
@dataclass(frozen=True)
class DecodeWeights:
    """A KDA layer's weights past its input projections: conv weights [C, 1, W] (q, k, v), the gate's second
    projection f_b [H·K, R], A_log [H'] (first H used), dt_bias [H·K], the output norm's weight [V] and eps."""
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    f_b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    lower_bound: float
    eps: float


def kda_decode_step_reference(xq, xk, xv, fa, beta_logits, gate, weights: DecodeWeights, state, conv_q, conv_k,
                              conv_v, slots=None) -> torch.Tensor:
    """One decode step of SPEC §3.2 in plain PyTorch, fp32 (fp64 for fp64 inputs), writing the rows' tails and
    states in place; the contract is the module's. Rows sharing a slot (padding) leave it holding one of them."""
    B, H = beta_logits.shape
    K, V = xq.shape[1] // H, xv.shape[1] // H
    dt = torch.float64 if xq.dtype == torch.float64 else torch.float32
    rows = torch.arange(B, device=xq.device) if slots is None else slots

    def conv_silu(x, tails, weight):  # SiLU(Σ_j w_j · [tail; x]_j), the tail shifted by one token in place
        xp = torch.cat([tails[rows].to(dt), x.to(dt)[:, None]], dim=1)  # [B, W, C]
        tails[rows] = xp[:, 1:].to(tails.dtype)
        return F.silu((xp * weight[:, 0, :].t().to(dt)).sum(1))

    q = conv_silu(xq, conv_q, weights.conv_q).view(B, H, K)
    k = conv_silu(xk, conv_k, weights.conv_k).view(B, H, K)
    v = conv_silu(xv, conv_v, weights.conv_v).view(B, H, V)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * K ** -0.5  # L2 norm, eps 1e-6, and the scale
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    f = (fa.to(dt) @ weights.f_b.to(dt).t()).view(B, H, K)
    alpha = kda_gate(f, weights.A_log, weights.dt_bias, weights.lower_bound).exp()  # [B, H, K]
    beta = torch.sigmoid(beta_logits.to(dt))
    S = state[rows].to(dt) * alpha[..., None]  # [B, H, K, V]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., None] * u[..., None, :]
    state[rows] = S.to(state.dtype)
    o = torch.einsum("bhk,bhkv->bhv", q, S)
    y = rms_norm_reference(o, weights.norm_weight, weights.eps) * torch.sigmoid(gate.to(dt).view(B, H, V))
    return y.reshape(B, H * V).to(xq.dtype)


force_fused_decode = Forced()  # `with force_fused_decode(True | False | None):` for a layer's decode step


def use_fused_decode(xq: torch.Tensor, state: torch.Tensor, head_dims: tuple[int, int], width: int,
                     needs_grad: bool) -> bool:
    """Whether a decode step with these inputs takes the one-kernel path (see the module's docstring)."""
    kernels = triton_module(KERNELS)
    fits = (kernels is not None and not needs_grad and state.dtype == torch.float32 and width >= 2
            and max(head_dims) <= kernels.MAX_HEAD_DIM)
    if force_fused_decode.value is not None:
        return force_fused_decode.value and fits
    if forced_backend() is not None:  # a test pinned every KDA core to one backend: not this kernel
        return False
    chosen = (fits and xq.is_cuda and xq.dtype in (torch.bfloat16, torch.float16, torch.float32)
              and switched_on(KERNELS))
    log_once(__name__, f"KDA decode step on {xq.device.type} {str(xq.dtype).removeprefix('torch.')}: "
                       f"{'one kernel' if chosen else 'unfused'}")
    return chosen


def kda_decode_step(xq, xk, xv, fa, beta_logits, gate, weights: DecodeWeights, state, conv_q, conv_k, conv_v,
                    slots=None) -> torch.Tensor:
    """`kda_decode_step_reference` as one kernel launch (k3.ops._kda_decode_triton); shapes checked first."""
    B, H = beta_logits.shape
    K, V = xq.shape[1] // H, xv.shape[1] // H
    W = weights.conv_q.shape[-1]
    want = {"xq": (B, H * K), "xk": (B, H * K), "xv": (B, H * V), "gate": (B, H * V),
            "conv_q": (state.shape[0], W - 1, H * K), "conv_k": (state.shape[0], W - 1, H * K),
            "conv_v": (state.shape[0], W - 1, H * V), "state": (state.shape[0], H, K, V)}
    got = dict(xq=xq, xk=xk, xv=xv, gate=gate, conv_q=conv_q, conv_k=conv_k, conv_v=conv_v, state=state)
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(got[name].shape)}")
    for name, t in dict(xq=xq, xk=xk, xv=xv, fa=fa, beta_logits=beta_logits, gate=gate).items():
        if t.stride(-1) != 1 or t.shape[0] != B:
            raise ValueError(f"{name} must have {B} rows and contiguous columns, got shape {list(t.shape)} "
                             f"strides {t.stride()}")
    if state.dtype != torch.float32 or state.stride()[1:] != (K * V, V, 1):
        raise ValueError(f"state must be fp32 with contiguous [H, K, V] slots, got {state.dtype} {state.stride()}")
    tails = (conv_q, conv_k, conv_v)
    if any(t.dtype != torch.float32 or t.stride(2) != 1 for t in tails):
        raise ValueError("conv tails must be fp32 [N, W−1, C] with contiguous channels")
    if slots is not None and (slots.shape != (B,) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slots must be an integer tensor [{B}], got {slots.dtype} {list(slots.shape)}")
    w = weights
    if triton_module(KERNELS) is None:
        raise RuntimeError("the fused KDA decode step needs triton")
    return call_op(  # the custom op registered by the kernel module (its function directly outside torch.compile)
        "kda_decode_step", xq, xk, xv, fa, beta_logits, gate, w.conv_q.contiguous(), w.conv_k.contiguous(),
        w.conv_v.contiguous(), w.f_b.contiguous(), w.A_log, w.dt_bias.reshape(-1), w.norm_weight, state, conv_q,
        conv_k, conv_v, slots, float(w.lower_bound), float(w.eps))
