"""Decode-time routed experts: each token's k selected experts read directly, with no sort, scatter or
grouped-GEMM offsets (the training path's permutation costs a dozen small kernels, which at decode batch sizes
take longer than reading the experts).

`selected_experts_situ_mlp_reference` gathers each slot's expert weights and multiplies (plain PyTorch, any
device: the definition). On CUDA, k3's Triton kernels do the same reading the weights in place, two ways:
- slot by slot (`k3.ops._moe_decode_triton`, two launches through the custom op k3::moe_selected_experts: gate and
  up with SiTU-GLU in the epilogue, then down with the routing weights' sum over the k choices), while N·k rows
  touch few experts (`use_selected_experts`);
- expert by expert past that, up to N·k = EXPERT_MAJOR_MAX_SLOTS (`k3.ops._moe_expert_major_triton`, three
  launches through the custom op k3::moe_expert_major; on an H200 a `small` layer's experts take 65.6 µs at 64
  tokens against the grouped path's 148): each expert's programs find the
  slots routed to it and read its weights once for all of them (`use_expert_major`).
`selected_experts_tail` adds what a LatentMoE does next at a decode batch, the routed norm of the sum and the shared
experts' SiTU-GLU, to the expert-major kernel's last launch (`selected_experts_tail_reference`: the three apart).
`force_expert_major(True)` takes the expert-major kernel on CPU tensors too (tests, under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch

from k3.ops.norm import rms_norm
from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import Forced, triton_module, use_triton_op

EXPERT_MAJOR = "_moe_expert_major_triton"
# N·k past which the grouped GEMMs take over from the expert-major kernel (N = 128 at top-8): each of its
# programs scans all N·k routing ids, and by then every expert has rows enough for the GEMMs' tiles. Untimed.
EXPERT_MAJOR_MAX_SLOTS = 1024
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
force_expert_major = Forced()  # `with force_expert_major(True | False | None):`, as triton_dispatch.Forced says


def use_selected_experts(num_rows: int, top_k: int, num_experts: int, needs_grad: bool) -> bool:
    """Whether a MoE call should take this path: inference, and N·k slots at most a quarter of the experts
    (beyond that most experts are read anyway, and the grouped GEMMs read each once)."""
    return not needs_grad and 0 < num_rows * top_k <= num_experts // 4


def use_expert_major(z: torch.Tensor, top_k: int, num_experts: int, weight_dtype: torch.dtype,
                     needs_grad: bool) -> bool:
    """Whether a MoE call past `use_selected_experts`' bound should read its experts in place, expert by expert:
    inference, E/4 < N·k ≤ EXPERT_MAJOR_MAX_SLOTS (z: [N, L]), expert weights in z's dtype, and the kernel chosen
    for z (triton_dispatch.use_triton_op, so inside torch.compile too) or forced on."""
    slots = z.shape[0] * top_k
    if needs_grad or force_expert_major.value is False or weight_dtype != z.dtype or z.dtype not in _KERNEL_DTYPES:
        return False
    if not (num_experts // 4 < slots <= EXPERT_MAJOR_MAX_SLOTS):
        return False
    if force_expert_major.value:
        return triton_module(EXPERT_MAJOR) is not None
    return use_triton_op(z, EXPERT_MAJOR)


def selected_experts_situ_mlp_reference(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                                        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                                        beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """r[n] = Σ_j weights[n, j] · W2_e SiTU(W1_e z[n], W3_e z[n]) with e = idx[n, j]; a slot with e < 0 is held
    elsewhere (expert-parallel serving, k3.serve.expert_shard) and adds nothing (the kernels skip its work).

    z: [N, L]; idx: [N, k] int; weights: [N, k]; w1, w3: [E, I, L]; w2: [E, L, I]. Returns [N, L] in z's dtype.
    """
    N, k = idx.shape
    weights = torch.where(idx >= 0, weights, 0)
    flat = idx.flatten().clamp(min=0)
    x = z.repeat_interleave(k, dim=0)[:, :, None]  # [N·k, L, 1]
    h = situ_glu(torch.bmm(w1[flat].to(z.dtype), x)[..., 0], torch.bmm(w3[flat].to(z.dtype), x)[..., 0],
                 beta_gate, beta_up)  # [N·k, I]
    y = torch.bmm(w2[flat].to(z.dtype), h[:, :, None])[..., 0].view(N, k, -1)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1)


def selected_experts_tail_reference(z, idx, weights, w1, w3, w2, betas, norm_weight, norm_eps, gate, up,
                                    shared_betas) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(r, norm_weight, norm_eps), or r itself without norm_weight; situ_glu(gate, up, *shared_betas)),
    r = `selected_experts_situ_mlp_reference(z, idx, weights, w1, w3, w2, *betas)`; gate, up: [N, I_shared]."""
    r = selected_experts_situ_mlp_reference(z, idx, weights, w1, w3, w2, *betas)
    return (r if norm_weight is None else rms_norm(r, norm_weight, norm_eps)), situ_glu(gate, up, *shared_betas)


def selected_experts_tail(z, idx, weights, w1, w3, w2, betas, norm_weight, norm_eps, gate, up,
                          shared_betas) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`selected_experts_tail_reference` by the expert-major kernels (the norm and the GLU in the combine's launch)
    where they take the call (`use_expert_major`: a decode batch past the slot-major kernel's few slots) and the
    GLU's inputs are [N, I] rows with contiguous columns in z's dtype; None elsewhere (the caller runs the three
    apart)."""
    N, k = idx.shape
    if not (w1.dtype == w2.dtype == w3.dtype and not use_selected_experts(N, k, w1.shape[0], False)
            and use_expert_major(z, k, w1.shape[0], w1.dtype, needs_grad=False)):
        return None
    kernels = triton_module(EXPERT_MAJOR)
    if not kernels.LAUNCH["tail"]:
        return None
    if (gate.shape != up.shape or gate.dim() != 2 or gate.shape[0] != N or gate.dtype != z.dtype
            or up.dtype != z.dtype or gate.stride(1) != 1 or up.stride(1) != 1
            or (norm_weight is not None and norm_weight.shape != (w1.shape[2],))):
        return None
    return kernels.expert_major_situ_mlp_tail(
        z, idx, weights, w1, w3, w2, *betas, norm_weight, norm_eps, gate, up, *shared_betas)


def selected_experts_situ_mlp(z, idx, weights, w1, w3, w2, beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """`selected_experts_situ_mlp_reference`, by k3's Triton kernels where they can run (the module docstring)."""
    N, k = idx.shape
    if w1.dtype == w2.dtype == w3.dtype and use_expert_major(z, k, w1.shape[0], w1.dtype, needs_grad=False):
        return triton_module(EXPERT_MAJOR).expert_major_situ_mlp(z, idx, weights, w1, w3, w2, float(beta_gate),
                                                                   float(beta_up))
    if use_triton_op(z, "_moe_decode_triton") and w1.dtype == w2.dtype == w3.dtype == z.dtype:
        return triton_module("_moe_decode_triton").selected_experts_situ_mlp(z, idx, weights, w1, w3, w2, beta_gate,
                                                                             beta_up)
    return selected_experts_situ_mlp_reference(z, idx, weights, w1, w3, w2, beta_gate, beta_up)
