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


class BatchCacheView:
    """Decode state of S sequences of different lengths whose new tokens are flattened into one row [1, N].

    The storage lives elsewhere (k3.serve's paged pool and state slab); the mixers only call these hooks.
    `cu_seqlens` [S+1] gives each sequence's slice of the flat row. A sequence with `T_s` new tokens and
    `kv_len_s` tokens of context after this step holds its new tokens at positions kv_len_s − T_s … kv_len_s − 1.
    """
    num_layers: int
    seq_len: int = 0  # unused (sequences differ); kept so the model's bookkeeping works unchanged
    cu_seqlens: torch.Tensor

    def kda_state(self, layer_idx: int) -> KDAState:
        """state [S, H, K, V] fp32 and conv tails [S, W−1, C] (zeros for fresh sequences)."""
        raise NotImplementedError

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        raise NotImplementedError

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor) -> None:
        """Store the new tokens' latent [N, R] and k_extra [N, rope]."""
        raise NotImplementedError

    def mla_context(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole context of the sequences `rows` [n]: latent [n, L, R], k_extra [n, L, rope] (padded to the
        longest, L) and kv_len [n]; this step's tokens already included."""
        raise NotImplementedError
