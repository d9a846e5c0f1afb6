"""Several bias-free projections of the same input as one GEMM at inference: `x @ [W1; W2; …]ᵀ`, split.

At decode a mixer's projections are matrix-vector products, each a kernel launch that reads its weight once;
one launch over the stacked weight reads the same bytes with fewer launches and a fuller card. The modules keep
their own parameters (the released checkpoint's names); the stacked copy is a cache that the decode drivers
switch on (`fuse_projections(model)`: the CUDA-graphed decode step, the serving engine's runner) and that is
refreshed in place (same storage, so a captured CUDA graph stays valid) whenever a weight changed. Until then,
and in any call that needs a weight's gradient, the separate projections run: training, and evaluation
inside training (FSDP's gathered weights, say), never hold the extra copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    """`fused(x)` == `[lin(x) for lin in linears]` (up to summation order), one GEMM once `refresh` switched the
    stacked weight on and no gradient is needed.

    Held as a plain attribute of the owning module (not a submodule, so neither `state_dict` nor `.to()` sees
    it): the cache follows the weights' device and dtype by rebuilding when they change."""

    def __init__(self, *linears: nn.Linear):
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinears stacks bias-free projections only")
        self.linears = linears
        self.weight: torch.Tensor | None = None
        self._key = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        weights = [lin.weight for lin in self.linears]
        if self.weight is None or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
            return [lin(x) for lin in self.linears]
        if not torch.compiler.is_compiling():  # (compiled code trusts the cache refreshed before compiling)
            self.refresh()
        return list(F.linear(x, self.weight).split([w.shape[0] for w in weights], dim=-1))

    def refresh(self, force: bool = False) -> None:
        """Bring the stacked weight up to date: rebuilt when a weight moved or changed dtype, rewritten in
        place when only its values changed (an optimizer step, a load). Changes are seen through each weight's
        version counter, which writes through `weight.data` bypass: `force` rewrites it regardless."""
        weights = [lin.weight for lin in self.linears]
        where = tuple((w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for w in weights)
        versions = tuple(w._version for w in weights)
        if self._key == (where, versions) and not force:
            return
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: refreshable outside inference
            stacked = torch.cat([w.detach() for w in weights])
            if self._key is not None and self._key[0] == where and self.weight is not None:
                self.weight.copy_(stacked)
            else:
                self.weight = stacked
        self._key = (where, versions)


def fuse_projections(model: nn.Module) -> None:
    """Switch on (or rewrite from the current weights) every FusedLinears of `model`; called by the decode
    drivers before they compile or capture a step, so the compiled code and the graph find the stacked weights."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedLinears) and not value.linears[0].weight.is_meta:
                value.refresh(force=True)
