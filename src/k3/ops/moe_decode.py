"""Decode-time routed experts: each token's k selected experts read directly, with no sort, scatter or
grouped-GEMM offsets (the training path's permutation costs a dozen small kernels, which at decode batch sizes
take longer than reading the experts).

`selected_experts_situ_mlp_reference` gathers each slot's expert weights and multiplies (plain PyTorch, any
device: the definition). On CUDA, k3's Triton kernels (`k3.ops._moe_decode_triton`) do the same in two launches
that read the weights in place: gate and up with SiTU-GLU in the epilogue, then down with the routing weights'
sum over the k choices. Worth it only while N·k rows touch few experts (`use_selected_experts`).
"""
from __future__ import annotations

import torch

from k3.ops.situ import situ_glu
from k3.ops.triton_dispatch import on_device, triton_module, use_triton


def use_selected_experts(num_rows: int, top_k: int, num_experts: int, needs_grad: bool) -> bool:
    """Whether a MoE call should take this path: inference, and N·k slots at most a quarter of the experts
    (beyond that most experts are read anyway, and the grouped GEMMs read each once)."""
    return not needs_grad and 0 < num_rows * top_k <= num_experts // 4


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


def selected_experts_situ_mlp(z, idx, weights, w1, w3, w2, beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """`selected_experts_situ_mlp_reference`, by k3's Triton kernels on CUDA where they can run."""
    if use_triton(z, "_moe_decode_triton") and w1.dtype == w2.dtype == w3.dtype == z.dtype:
        with on_device(z):
            return triton_module("_moe_decode_triton").selected_experts_situ_mlp(
                z, idx, weights, w1, w3, w2, beta_gate, beta_up)
    return selected_experts_situ_mlp_reference(z, idx, weights, w1, w3, w2, beta_gate, beta_up)
