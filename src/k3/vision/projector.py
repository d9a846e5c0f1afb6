"""The 2×2 patch merge (`sd2_tpool` for still images) and the `patchmergerv2` projector (SPEC §7):
Linear → exact GELU → Linear → RMSNorm(1e-5), one text-width vector per merged token."""
from __future__ import annotations

import torch
from torch import nn

from k3.model.norm import RMSNorm
from k3.vision.config import VisionConfig


def merge_patches(features: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    """features: [N, D] tower output for packed images; grid_thws: [n, 3] → [M, 4D], M = Σ (h/2)(w/2).
    Each merged token concatenates its [top-left, top-right, bottom-left, bottom-right] patches; merged tokens
    are in row-major order, image after image. (Frames of a video chunk would be averaged; t = 1 here.)"""
    out, start = [], 0
    D = features.shape[-1]
    for t, h, w in torch.as_tensor(grid_thws).tolist():
        if h % 2 or w % 2:
            raise ValueError(f"a {h}x{w} patch grid cannot be merged 2x2 (sides must be even)")
        n = t * h * w
        x = features[start:start + n].reshape(t, h // 2, 2, w // 2, 2, D)
        # [t, h/2, w/2, dy, dx, D]: (dy, dx) = (0,0) TL, (0,1) TR, (1,0) BL, (1,1) BR
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(t, (h // 2) * (w // 2), 4 * D)
        out.append(x.mean(0))
        start += n
    return torch.cat(out)


class PatchMergerProjector(nn.Module):
    """Names as released: `proj.0` (4096 → 4096), `proj.2` (4096 → text width), `post_norm`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(cfg.mm_hidden_size, cfg.mm_hidden_size, bias=False), nn.GELU(),
                                  nn.Linear(cfg.mm_hidden_size, cfg.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """merged: [M, 4D] → [M, text_hidden_size]."""
        return self.post_norm(self.proj(merged))
