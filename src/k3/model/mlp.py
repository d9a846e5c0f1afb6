"""The SiTU-GLU MLP: layer 0's dense MLP and the fused shared experts."""
import torch
from torch import nn

from k3.config import K3Config
from k3.ops.fused_linear import FusedLinears
from k3.ops.fused_situ import situ_glu_fast
from k3.ops.gemv import DecodeLinear


class SiTUMLP(nn.Module):
    """`down(SiTU-GLU(gate(x), up(x)))` with `gate_proj`, `up_proj`: [I, D] and `down_proj`: [D, I]."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int, join_inputs: bool = True):
        """join_inputs: gate and up as one GEMM at inference (fuse_projections switches the stacked weight on);
        off where the owner stacks them itself (the MoE's shared experts, in its input projections)."""
        super().__init__()
        # nn.Linear's, taking k3.ops.gemv's kernel for a decode step's few rows where chosen
        self.gate_proj = DecodeLinear(hidden, intermediate, bias=False)
        self.up_proj = DecodeLinear(hidden, intermediate, bias=False)
        self.down_proj = DecodeLinear(intermediate, hidden, bias=False)
        self.betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.in_proj = FusedLinears(self.gate_proj, self.up_proj) if join_inputs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one row only (a batch-1 decode step): the joined GEMM's halves are then contiguous views; at more rows
        # the SiTU-GLU kernel would copy each (two launches for the one saved). Training: two GEMMs, as before.
        if self.in_proj is not None and x.numel() == x.shape[-1] and not torch.is_grad_enabled():
            gate, up = self.in_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # one fused Triton pass on CUDA (saves only gate and up for backward), the reference elsewhere
        return self.down_proj(situ_glu_fast(gate, up, *self.betas))
