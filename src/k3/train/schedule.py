"""Learning-rate schedule: warmup–stable–decay (WSD) as a multiplier on each group's `base_lr`."""

from __future__ import annotations

import torch

__all__ = ["wsd_multiplier", "apply_lr"]


def wsd_multiplier(
    step: int, total_steps: int, warmup_steps: int, decay_fraction: float = 0.2, final: float = 0.0
) -> float:
    """LR multiplier at optimizer step `step` (0-based).

    Warmup: `(step + 1) / warmup_steps` for the first `warmup_steps` steps (1/warmup ... 1). Stable at 1.
    Decay: linear from 1 at step `total_steps - D` to `final` at step `total_steps`, with
    `D = round(decay_fraction * total_steps)`; steps >= total_steps return `final`. Where warmup and decay
    overlap the smaller multiplier wins.
    """
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in [0, 1], got {decay_fraction!r}")
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"final must be in [0, 1], got {final!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    if step >= total_steps:
        return float(final)
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    decay_steps = round(decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if decay_steps > 0 and step >= decay_start:
        progress = (step - decay_start) / decay_steps
        decay = 1.0 + (final - 1.0) * progress
    else:
        decay = 1.0
    return float(min(warm, decay))


def apply_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Set `lr = base_lr * multiplier` for every param group (groups without `base_lr` get one from `lr`)."""
    for group in optimizer.param_groups:
        base = group.setdefault("base_lr", group["lr"])
        group["lr"] = base * multiplier
