"""SiTU-GLU, K3's bounded gated activation (SPEC §3.5)."""
import torch


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """`h = [β1 tanh(g/β1) · sigmoid(g)] ⊙ [β2 tanh(u/β2)]` in float32; |h| ≤ β1·β2 (= 100).

    gate, up: [..., I] of the same shape; returns gate's dtype. Equals SwiGLU (`silu(g) · u`) near zero.
    """
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    dt = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(dt), up.to(dt)
    h = beta_gate * torch.tanh(g / beta_gate) * torch.sigmoid(g) * (beta_up * torch.tanh(u / beta_up))
    return h.to(gate.dtype)
