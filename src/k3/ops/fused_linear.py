"""Several bias-free projections of the same input: one GEMM at inference, one input gradient in training.

At decode a mixer's projections are matrix-vector products, each a kernel launch that reads its weight once;
one launch over the stacked weight reads the same bytes with fewer launches and a fuller card. The modules keep
their own parameters (the released checkpoint's names); the stacked copy is a cache that the decode drivers
switch on (`fuse_projections(model)`: the CUDA-graphed decode step, the serving engine's runner) and that is
refreshed in place (same storage, so a captured CUDA graph stays valid) whenever a weight changed. Until then,
and in any call that needs a gradient, one GEMM per projection runs (the narrow ones joined, below): training,
and evaluation inside training (FSDP's gathered weights, say), never hold the extra copy.

In training the projections run as one autograd node (`_SharedInputProjections`) whose backward accumulates
every projection's ∂L/∂x into one buffer, each GEMM after the first adding into it in its epilogue (`addmm_`,
β = 1). Separate nn.Linear calls would each write their own ∂L/∂x and autograd would add them pairwise: n − 1
extra passes of three activations each (read, read, write). One GEMM over the stacked gradients needs them
copied side by side first, a pass of its own, so it is taken only for the narrow projections (KDA's f_a and beta,
`NARROW_ROWS`), whose thin products run far below cuBLAS's rate apart; their forward is one GEMM too, with or
without a gradient (the same bits either way).
Under autocast the input is cast once for all n GEMMs (autocast casts it per call). Tensor subclasses (a
DTensor's own linear) keep the nn.Linear calls. Switch: K3_NO_SHARED_INPUT_GRAD (k3.envs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3 import envs
from k3.ops.gemv import linear


class DerivedWeight:
    """A tensor made from some modules' weights, `make(*weights)`: a cache (`weight`), None until `refresh`
    switches it on, then kept up to date with the weights (see `refresh`).

    Held as a plain attribute of the owning module (not a submodule, so neither `state_dict` nor `.to()` sees
    it): the cache follows the weights' device and dtype by rebuilding when they change."""

    def __init__(self, make, *owners: nn.Module):
        self.make = make
        self.owners = owners
        self.weight: torch.Tensor | None = None
        self._key = None

    def current(self) -> torch.Tensor:
        """The derived tensor for this call: the refreshed cache where it is on and no gradient is needed, else
        `make` of the weights as autograd sees them."""
        weights = [o.weight for o in self.owners]
        if self.weight is None or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
            return self.make(*weights)
        if not torch.compiler.is_compiling():  # (compiled code trusts the cache refreshed before compiling)
            self.refresh()
        return self.weight

    def refresh(self, force: bool = False) -> None:
        """Bring the cache up to date: rebuilt when a weight moved or changed dtype, rewritten in place when only
        its values changed (an optimizer step, a load: the same storage, so a captured CUDA graph stays valid).
        Changes are seen through each weight's version counter, which writes through `weight.data` bypass:
        `force` rewrites it regardless."""
        weights = [o.weight for o in self.owners]
        where = tuple((w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for w in weights)
        versions = tuple(w._version for w in weights)
        if self._key == (where, versions) and not force:
            return
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: refreshable outside inference
            made = self.make(*(w.detach() for w in weights))
            if self._key is not None and self._key[0] == where and self.weight is not None:
                self.weight.copy_(made)
            else:
                self.weight = made
        self._key = (where, versions)


class StackedWeights(DerivedWeight):
    """Several modules' weights side by side along dim 0 in one tensor (a `DerivedWeight`)."""

    def __init__(self, *owners: nn.Module):
        super().__init__(_stacked, *owners)


def _stacked(*weights: torch.Tensor) -> torch.Tensor:
    return torch.cat(weights)


# The stacked weight's rows (the fused output's row length) padded to a multiple of this: cuBLAS's Hopper GEMMs
# need 16-byte-aligned leading dimensions (8 elements at 16 bits). KDA's 6,284 columns (q, k, v, f, beta of 12
# heads, g) fell back to an sm80 kernel: 1.9 ms of a 2,048-token serving step on an H200, its largest kernel.
ROW_ALIGN = 8


def aligned_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of ROW_ALIGN: the stacked weight's rows."""
    return rows + -rows % ROW_ALIGN


def _stacked_aligned(*weights: torch.Tensor) -> torch.Tensor:
    """The weights side by side along dim 0, then zero rows up to `aligned_rows` (outputs never read)."""
    w = _stacked(*weights)
    pad = aligned_rows(w.shape[0]) - w.shape[0]
    return torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w


class FusedLinears(DerivedWeight):
    """`fused(x)` == `[lin(x) for lin in linears]` (up to summation order), one GEMM once `refresh` switched the
    stacked weight on and no gradient is needed."""

    def __init__(self, *linears: nn.Linear):
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedLinears stacks bias-free projections only")
        super().__init__(_stacked_aligned, *linears)
        self.linears = linears

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        weights = [lin.weight for lin in self.linears]
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
        if self.weight is not None and not needs_grad:  # the kept stacked weight: one GEMM
            sizes = [w.shape[0] for w in weights]
            return list(linear(x, self.current())[..., :sum(sizes)].split(sizes, dim=-1))
        if envs.current().no_shared_input_grad or not _plain_tensors(x, *weights):
            return [lin(x) for lin in self.linears]
        if needs_grad:
            return shared_input_projections(x, weights)
        return list(_projections(x, weights))  # the training node's own GEMMs: the same bits with or without grad


def joined_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts, -1)`, as a view without a copy where the parts are adjacent column slices of one tensor
    (what FusedLinears returns) and no gradient is needed: a view to read, not to write into. Under torch.compile
    the plain cat (Dynamo cannot trace storage offsets; the compiled graph plans its own buffers)."""
    if torch.compiler.is_compiling():
        return torch.cat(parts, -1)
    first = parts[0]
    adjacent = not (torch.is_grad_enabled() and any(p.requires_grad for p in parts)) and first.stride(-1) == 1
    offset = first.storage_offset()
    for p in parts:
        adjacent = adjacent and (p.dtype == first.dtype and p.shape[:-1] == first.shape[:-1]
                                 and p.stride() == first.stride() and p.storage_offset() == offset
                                 and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        offset += p.shape[-1]
    if not adjacent:
        return torch.cat(parts, -1)
    return first.as_strided((*first.shape[:-1], offset - first.storage_offset()), first.stride(),
                            first.storage_offset())


def _plain_tensors(*tensors: torch.Tensor) -> bool:
    """Plain dense tensors (not DTensors or other subclasses, which bring their own linear: tensor parallelism)."""
    return all(type(t) is torch.Tensor or type(t) is nn.Parameter for t in tensors)


def shared_input_projections(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[F.linear(x, w) for w in weights]` with one accumulated ∂L/∂x (`_SharedInputProjections`). Autocast is
    applied here, as F.linear would: x and the weights are cast to its dtype once, outside the node."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        x, weights = x.to(dtype), [w.to(dtype) for w in weights]
    with torch.autocast(device, enabled=False):
        return list(_SharedInputProjections.apply(x, *weights))


# Projections at most this wide run as one GEMM where a set has two or more (KDA's f_a, 128 wide, and beta, one
# column a head): cuBLAS runs such thin products far below its square-GEMM rate (H100, 32,768 × 1,536 in:
# beta's 12 columns at 17 TFLOP/s, its input gradient, 24-byte rows, at 9; f_a's 128 at ~200), and the joined
# product, padded to ROW_ALIGN, is one thin GEMM in place of several (`benchmarks/gemm_census.py` times each).
NARROW_ROWS = 256


def _narrow(weights) -> list[int]:
    """Indices of the weights that share one GEMM (`NARROW_ROWS`): none unless two or more are narrow."""
    narrow = [i for i, w in enumerate(weights) if w.shape[0] <= NARROW_ROWS]
    return narrow if len(narrow) > 1 else []


def _projections(x: torch.Tensor, weights) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each weight: a GEMM a weight (contiguous outputs, as nn.Linear's), the narrow ones
    (`_narrow`) one GEMM whose outputs are column views of it."""
    narrow = _narrow(weights)
    outs = [None if i in narrow else F.linear(x, w) for i, w in enumerate(weights)]
    if narrow:
        sizes = [weights[i].shape[0] for i in narrow]
        joined = F.linear(x, _stacked_aligned(*(weights[i] for i in narrow)))
        for i, y in zip(narrow, joined[..., :sum(sizes)].split(sizes, dim=-1)):
            outs[i] = y
    return tuple(outs)


class _SharedInputProjections(torch.autograd.Function):
    """Forward: `_projections`. Backward: ∂L/∂W_i = g_iᵀ x each (the narrow ones' from one GEMM over their
    gradients side by side); ∂L/∂x = Σ_i g_i W_i into one buffer, the first GEMM writing it and the others adding
    into it."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.set_materialize_grads(False)  # an unused output brings no gradient, not a zero tensor
        ctx.save_for_backward(x, *weights)
        return _projections(x, weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        needs = ctx.needs_input_grad
        narrow = _narrow(weights)
        dx, dws = None, [None] * len(weights)

        def add(g2, w):  # ∂L/∂x += g2 w, the first product writing the buffer
            nonlocal dx
            if needs[0]:
                dx = torch.mm(g2, w) if dx is None else dx.addmm_(g2, w)

        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None or i in narrow:
                continue
            g2 = g.reshape(-1, g.shape[-1])
            add(g2, w)
            dws[i] = g2.t().mm(x2) if needs[1 + i] else None
        if any(grads[i] is not None for i in narrow):
            # stacked again, not kept from the forward: a weight-sized save would make the saved bytes per token
            # depend on the length (benchmarks/activation_memory.py scales a short measurement by tokens)
            w = _stacked_aligned(*(weights[i] for i in narrow))
            parts = [grads[i].reshape(-1, weights[i].shape[0]) if grads[i] is not None
                     else x2.new_zeros(x2.shape[0], weights[i].shape[0]) for i in narrow]
            pad = w.shape[0] - sum(p.shape[1] for p in parts)  # the zero rows' columns
            g2 = torch.cat(parts + ([x2.new_zeros(x2.shape[0], pad)] if pad else []), -1)
            add(g2, w)
            if any(needs[1 + i] for i in narrow):
                dw, start = g2.t().mm(x2), 0
                for i, p in zip(narrow, parts):
                    if needs[1 + i] and grads[i] is not None:
                        dws[i] = dw[start:start + p.shape[1]]
                    start += p.shape[1]
        return (None if dx is None else dx.view(x.shape)), *dws


def fuse_projections(model: nn.Module) -> None:
    """Switch on (or rewrite from the current weights) every DerivedWeight of `model` (the FusedLinears, KDA's
    short-conv weights, MLA's absorbed query weight); called by the decode drivers before they compile or capture a
    step, so the compiled code and the graph find the kept weights."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, DerivedWeight) and not value.owners[0].weight.is_meta:
                value.refresh(force=True)
