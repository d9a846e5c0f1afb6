"""MLA's gated output `o ⊙ σ(gate)` (SPEC §3.3) flattened over the heads: the torch reference and the one-pass
Triton kernels (k3.ops._sigmoid_gate_triton; K3_NO_TRITON=_sigmoid_gate_triton turns them off).

With s = σ(gate): out = o·s; ∂L/∂o = ∂L/∂out·s; ∂L/∂gate = ∂L/∂out·o·s(1 − s).
"""
import torch
from torch.autograd.function import once_differentiable

from k3.ops.triton_dispatch import triton_module, use_triton


def sigmoid_gate_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o: [..., H, V]; gate: [..., H·V]. Returns [..., H·V] (the layer's original two ops)."""
    return o.reshape(gate.shape) * torch.sigmoid(gate)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_gate_reference` in one kernel each way where the Triton kernels run (CUDA, one float dtype)."""
    if (o.numel() and o.dtype == gate.dtype and use_triton(o, "_sigmoid_gate_triton")
            and o.shape[:-2] == gate.shape[:-1] and o.shape[-2] * o.shape[-1] == gate.shape[-1]):
        return _SigmoidGate.apply(o, gate)
    return sigmoid_gate_reference(o, gate)


def _rows(o: torch.Tensor) -> torch.Tensor:
    """o as [N, H, V] with a unit last stride: a view where the leading dims merge (attention's output, a slice
    of wider heads included), else a copy."""
    o3 = o.reshape(-1, *o.shape[-2:])
    return o3 if o3.stride(-1) == 1 else o3.contiguous()


class _SigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate):
        o3, g2 = _rows(o), gate.reshape(-1, gate.shape[-1]).contiguous()
        ctx.save_for_backward(o3, g2)
        ctx.o_shape = o.shape
        return triton_module("_sigmoid_gate_triton").gate_forward(o3, g2).view(gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        o3, g2 = ctx.saved_tensors
        d_o, d_g = triton_module("_sigmoid_gate_triton").gate_backward(grad.reshape(g2.shape).contiguous(), o3, g2)
        return d_o.view(ctx.o_shape), d_g.view(grad.shape)
