"""Per-sequence decode state, passed in and out of the model explicitly (never hidden in modules)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    """One KDA layer: recurrent state [B, H, K, V] (fp32) and the last W−1 inputs of the q, k, v convs."""
    state: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor


@dataclass
class MLAState:
    """One MLA layer, absorbed form: normalised latent [B, S, kv_lora_rank] and shared k_extra [B, S, rope]."""
    latent: torch.Tensor
    k_extra: torch.Tensor

    def append(self, latent: torch.Tensor, k_extra: torch.Tensor) -> None:
        self.latent = torch.cat([self.latent, latent], dim=1)
        self.k_extra = torch.cat([self.k_extra, k_extra], dim=1)


@dataclass
class K3Cache:
    """Decode state of a batch of sequences of equal length `seq_len`: one entry per layer (None until filled)."""
    num_layers: int
    seq_len: int = 0
    layers: list = field(default_factory=list)

    def __post_init__(self):
        if not self.layers:
            self.layers = [None] * self.num_layers

    def nbytes(self) -> int:
        total = 0
        for s in self.layers:
            if s is not None:
                total += sum(t.numel() * t.element_size() for t in vars(s).values())
        return total
