"""KDA's core, the delta rule from the mixer's features, and the one place that picks who computes it.

Every KDA forward (training, packed documents, decode, serving's varlen batch, context parallelism) ends in
`kda_core`; only the layout it passes differs (dense rows, cu_seqlens, initial states). `select_backend` picks
"fla" (flash-linear-attention's kernels, k3.ops.kda_fla) where fla can run the tensors, else "reference"
(k3.ops.kda's plain PyTorch). `force_backend` pins the choice for a block (tests and benchmarks compare the
two that way); the choice made for each (device, dtype) is logged once.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from k3.ops.lazy_dynamo import assume_constant_result
from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent
from k3.ops.kda_fla import (fla_kda_chunk, fla_kda_gated, fla_kda_recurrent, fla_usable, lean_enabled,
                            safe_gate_ok)
from k3.ops.norm import l2_norm

__all__ = ["BACKENDS", "select_backend", "force_backend", "forced_backend", "takes_graph_plan", "kda_core"]

BACKENDS = ("reference", "fla")
_forced: str | None = None
_logged: set = set()


@contextlib.contextmanager
def force_backend(name: str | None):
    """Within the block every KDA core runs on `name` ("reference" or "fla"; None: the default choice)."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"KDA backend must be one of {BACKENDS} or None, got {name!r}")
    saved, _forced = _forced, name
    try:
        yield
    finally:
        _forced = saved


def forced_backend() -> str | None:
    """The backend `force_backend` pinned for the current block, or None."""
    return _forced


def select_backend(q: torch.Tensor) -> str:
    """The backend for features like q [..., H, K]: the forced one, else fla where usable, else the reference."""
    name = _forced or ("fla" if q.numel() and fla_usable(q, q.shape[-1]) else "reference")
    log_once(__name__, f"KDA core on {q.device.type} {str(q.dtype).removeprefix('torch.')}: {name}")
    return name


@assume_constant_result  # Dynamo runs it as it traces: a logger call in a compiled region breaks it
def log_once(logger: str, message: str) -> bool:
    """Log `message` at INFO on `logger` the first time it comes (a backend choice, said once per process)."""
    if (logger, message) not in _logged:
        _logged.add((logger, message))
        logging.getLogger(logger).info(message)
    return True


def takes_graph_plan(q: torch.Tensor, lower_bound: float) -> bool:
    """Whether the chunked core of q's device and dtype (q [..., H, K], non-empty) runs over a CUDA-graph chunk
    plan (k3.ops.kda_fla_lean.ChunkPlan.graph): fla's lean entry in its graph mode. The references and fla's public
    entry plan from the host offsets on every call, so a graph captured over them would keep the capture's
    documents."""
    return select_backend(q) == "fla" and safe_gate_ok(lower_bound) and lean_enabled()


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, *,
             initial_state: torch.Tensor | None = None, output_final_state: bool = False,
             cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
             recurrent: bool = False, state_in_place: bool = False, plan=None,
             backend: str | None = None, qk_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kda(l2(q), l2(k), v, kda_gate(f, A_log, dt_bias, lower_bound), sigmoid(beta_logits)).

    q, k: [B, T, H, K] after the conv and SiLU (not yet L2-normalised; with `qk_normalized`, already: the norms are
    then skipped); v: [B, T, H, V];
    f: [B, T, H, K] the gate's low-rank projection; beta_logits: [B, T, H]; initial_state: [N, H, K, V] fp32
    (N = B, or the documents of cu_seqlens). recurrent: the step-by-step form (decode), else the chunked one:
    the same function. Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None).
    state_in_place (decode over a preallocated cache): the final state is written over initial_state and that
    tensor is returned; fla's recurrent kernel does it without a copy (fp32 contiguous states).
    cu_seqlens_cpu: cu_seqlens' values on the host, when the caller knows them (the serving layout does): both
    backends then plan the documents from it instead of reading the device tensor back.
    plan: fla's chunk plan of cu_seqlens made by the caller (k3.ops.kda_fla_lean.ChunkPlan: a CUDA-graph layout's
    fixed-shape one, k3.serve.runner.StaticKDAView); the torch references read cu_seqlens_cpu instead.
    """
    backend = backend or select_backend(q)
    if backend not in BACKENDS:
        raise ValueError(f"KDA backend must be one of {BACKENDS}, got {backend!r}")
    if state_in_place and initial_state is None:
        raise ValueError("state_in_place needs an initial_state to write the final state over")
    state_args = dict(initial_state=initial_state, output_final_state=output_final_state or state_in_place,
                      cu_seqlens=cu_seqlens)
    fla_args = dict(state_args, cu_seqlens_cpu=cu_seqlens_cpu)
    in_kernel = (state_in_place and recurrent and initial_state.dtype == torch.float32
                 and initial_state.is_contiguous() and not (torch.is_grad_enabled() and q.requires_grad))
    if backend == "fla" and safe_gate_ok(lower_bound):  # gate, L2 norms and beta inside fla's kernels
        if in_kernel:
            return fla_kda_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, recurrent=True,
                                 state_in_place=True, qk_normalized=qk_normalized, **fla_args)
        o, state = fla_kda_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound,
                                 recurrent=None if recurrent else False, plan=plan, qk_normalized=qk_normalized,
                                 **fla_args)
        return _written_over(o, state, initial_state if state_in_place else None)
    if not qk_normalized:
        q, k = l2_norm(q), l2_norm(k)
    beta = torch.sigmoid(beta_logits.float() if beta_logits.dtype != torch.float64 else beta_logits)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    if backend == "fla":  # gates below fla's safe bound: its general kernels on the gates computed here
        if plan is not None and plan.graph:
            raise ValueError("a CUDA-graph chunk plan needs fla's safe gate (lower_bound in its range)")
        o, state = (fla_kda_recurrent if recurrent else fla_kda_chunk)(q, k, v, g, beta, **fla_args)
    else:  # the references read the bounds only, on the host
        if plan is not None and plan.graph and q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("the KDA reference plans on the host: a CUDA graph of it would keep the capture's "
                             "documents (a graph plan needs fla's lean chunked core: `takes_graph_plan`)")
        if cu_seqlens_cpu is not None:
            state_args["cu_seqlens"] = cu_seqlens_cpu
        o, state = (kda_recurrent if recurrent else kda_chunk)(q, k, v, g, beta, **state_args)
    return _written_over(o, state, initial_state if state_in_place else None)


def _written_over(o, state, target):
    """(o, state), with the state copied over `target` and `target` returned when one is given."""
    if target is None:
        return o, state
    return o, target.copy_(state)
