"""RMSNorm as a module whose parameter is named `weight`, as in the checkpoint."""
import torch
from torch import nn

from k3.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
