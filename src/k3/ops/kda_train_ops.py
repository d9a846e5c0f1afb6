"""KDA's short conv and core as torch.library custom ops with their autograd: how a compiled training region
(k3.train.compiled_regions) holds them, each one opaque call forward and one backward.

Dynamo cannot trace either as it is: the conv's backward recomputes through `torch.autograd.grad`, and the core
plans packed documents on the host (the reference reads cu_seqlens back, fla's chunk_kda plans its chunks and
launches Triton kernels from its own autograd.Function). Forward: the eager function itself (`short_conv`, the
dense layout's `kda_core`, with their kernels where those run). Backward: a second op that recomputes that
function from the saved inputs and differentiates it with autograd, so the gradients are the eager function's own
(the price: the forward runs twice, as the conv's eager backward already does).

Ops: `k3::kda_short_conv` (SiLU(conv(x)) of a fresh row, no carried tail) and `k3::kda_core_train` (the chunked
core from no initial state, packed documents given as doc_ids). Outputs are contiguous, as their fake kernels say
(inductor lays out what follows by the fake tensors' strides).
"""
from __future__ import annotations

import contextlib
import types

import torch

from k3.ops.conv import short_conv

__all__ = ["kda_short_conv", "kda_core_train"]

_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


@contextlib.contextmanager
def _autograd_inside_op(device_type: str):
    """Autograd recording inside a custom op's kernel, which the dispatcher runs below the autograd keys (an op's
    backward recomputes its function and differentiates it); autocast off, since the graph already fixed the
    inputs' dtypes and the forward op ran on them as given."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad(), torch.autocast(device_type, enabled=False):
        yield


def _grads(outputs: torch.Tensor, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """d(outputs)/d(inputs) · grad, contiguous, zeros for an input the output does not depend on."""
    got = torch.autograd.grad(outputs, inputs, grad, allow_unused=True)
    return [torch.zeros_like(t, memory_format=torch.contiguous_format) if g is None else g.contiguous()
            for g, t in zip(got, inputs)]


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(True) for t in tensors]


# ---------------------------------------------------------------------------------------------- short conv

@torch.library.custom_op("k3::kda_short_conv", mutates_args=())
def kda_short_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """`short_conv(x, weight, None, doc_ids, silu)[0]`: x [B, T, C] → [B, T, C] in x's dtype."""
    with torch.autocast(x.device.type, enabled=False):
        return short_conv(x, weight, None, doc_ids, silu)[0].contiguous()


@kda_short_conv.register_fake
def _(x, weight, doc_ids, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("k3::kda_short_conv_backward", mutates_args=())
def _short_conv_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None,
                         silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with _autograd_inside_op(x.device.type):
        xl, wl = _leaves(x, weight)
        y = short_conv(xl, wl, None, doc_ids, silu)[0]
        gx, gw = _grads(y, [xl, wl], grad)
    return gx, gw


@_short_conv_backward.register_fake
def _(grad, x, weight, doc_ids, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(weight.shape, dtype=weight.dtype,
                                                                              device=weight.device)


def _conv_setup(ctx, inputs, output):
    x, weight, doc_ids, silu = inputs
    ctx.save_for_backward(x, weight, doc_ids)
    ctx.silu = silu


def _conv_backward(ctx, grad):
    x, weight, doc_ids = ctx.saved_tensors
    gx, gw = _short_conv_backward(grad, x, weight, doc_ids, ctx.silu)
    return gx, gw, None, None


kda_short_conv.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---------------------------------------------------------------------------------------------- core

def _core(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, doc_ids):
    """The dense layout's core from no state (k3.model.kda, imported here: it imports this package's ops)."""
    from k3.model.kda import DenseLayout

    params = types.SimpleNamespace(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return DenseLayout(None, doc_ids).core(params, q, k, v, f, beta_logits, None)


@torch.library.custom_op("k3::kda_core_train", mutates_args=())
def kda_core_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                   doc_ids: torch.Tensor | None) -> torch.Tensor:
    """`kda_core` of rows [B, T] from no initial state (packed documents where doc_ids [B, T]): o [B, T, H, V] in
    v's dtype; the backend is k3.ops.kda_core's choice."""
    with torch.autocast(q.device.type, enabled=False):
        return _core(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, doc_ids).contiguous()


@kda_core_train.register_fake
def _(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, doc_ids):
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


@torch.library.custom_op("k3::kda_core_train_backward", mutates_args=())
def _core_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                   beta_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                   doc_ids: torch.Tensor | None) -> list[torch.Tensor]:
    with _autograd_inside_op(q.device.type):
        leaves = _leaves(q, k, v, f, beta_logits, A_log, dt_bias)
        o = _core(*leaves, lower_bound, doc_ids)
        return _grads(o, leaves, grad)


@_core_backward.register_fake
def _(grad, q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, doc_ids):
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, f, beta_logits, A_log, dt_bias)]


def _core_setup(ctx, inputs, output):
    *tensors, lower_bound, doc_ids = inputs
    ctx.save_for_backward(*tensors, doc_ids)
    ctx.lower_bound = lower_bound


def _core_backward_rule(ctx, grad):
    *tensors, doc_ids = ctx.saved_tensors
    return *_core_backward(grad, *tensors, ctx.lower_bound, doc_ids), None, None


kda_core_train.register_autograd(_core_backward_rule, setup_context=_core_setup)
