"""The SiTU-GLU MLP: layer 0's dense MLP and the fused shared experts."""
import torch
from torch import nn

from k3.config import K3Config
from k3.ops.fused_situ import situ_glu_fast
from k3.ops.gemv import DecodeLinear


class SiTUMLP(nn.Module):
    """`down(SiTU-GLU(gate(x), up(x)))` with `gate_proj`, `up_proj`: [I, D] and `down_proj`: [D, I]."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int):
        super().__init__()
        # nn.Linear's, taking k3.ops.gemv's kernel for a decode step's few rows where chosen
        self.gate_proj = DecodeLinear(hidden, intermediate, bias=False)
        self.up_proj = DecodeLinear(hidden, intermediate, bias=False)
        self.down_proj = DecodeLinear(intermediate, hidden, bias=False)
        self.betas = (config.activation_situ_beta, config.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused Triton pass on CUDA (saves only gate and up for backward), the reference elsewhere
        return self.down_proj(situ_glu_fast(self.gate_proj(x), self.up_proj(x), *self.betas))
