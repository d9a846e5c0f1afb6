"""One home for making a test model's trivially-initialised parts random, so that every path matters: the AttnRes
queries (`res_proj`, zero at init), KDA's `A_log` (zero), optionally the norm weights (one), and the router's
score-correction bias (zero); and the tiny training model the gradient tests share (`random_tiny_model`)."""
from __future__ import annotations

import torch


@torch.no_grad()
def randomize_trivial_parts(model: torch.nn.Module, g: torch.Generator, bias_scale: float | None = None,
                            norm_scale: float | None = None) -> torch.nn.Module:
    """In place, drawing from `g` in parameter order: res_proj ~ 0.2·N(0, 1), A_log ~ U(-1, 1), norm weights
    × (1 + norm_scale·N(0, 1)) when norm_scale is given; then the router bias ~ bias_scale·N(0, 1) when given."""
    for name, p in model.named_parameters():
        if name.endswith("res_proj.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.0, generator=g)
        elif norm_scale is not None and name.endswith("norm.weight"):
            p.mul_(1 + norm_scale * torch.randn(p.shape, generator=g))
    if bias_scale is not None:
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * bias_scale)
    return model


def random_tiny_model(seed: int, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    """The tiny preset, its weights from `seed` and every trivial part random (router bias 0.01·N(0, 1), norm
    weights × (1 + 0.1·N(0, 1))), in `dtype` on `device`, in training mode."""
    from k3 import K3Config, K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=seed)
    randomize_trivial_parts(model, torch.Generator().manual_seed(seed + 1), bias_scale=0.01, norm_scale=0.1)
    return model.to(device, dtype).train()
