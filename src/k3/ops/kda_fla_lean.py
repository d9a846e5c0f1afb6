"""Inference entries to fla's forward internals: the chunked KDA prefill and KDA's gated output norm without the
per-call host work of fla's training entries (on by default; K3_FLA_LEAN=0 turns it off, see k3.envs).

fla's public `chunk_kda` serves training: per call it passes every argument through an input guard (a
`.contiguous()` each), an autocast decorator, a backend dispatcher at each of its stages (sorting the backends and
reading environment variables on every call), an autograd.Function that saves 23 tensors, and a chunk plan looked up
by the tensors' identity, whose first build waits for a pageable host-to-device copy. A serving step runs it once
per KDA layer with the same layout. Here, under no autograd:
- `chunk_plan` builds the plan (chunk indices, chunk offsets) once a step on the host, from the step's host
  cu_seqlens, and sends it up in one pinned, non-blocking copy: the step no longer waits inside fla;
- `chunk_kda_prefill` runs the same forward kernels with the L2 norms, the beta sigmoid and the gate fused as the
  training path fuses them (`use_qk_l2norm_in_kernel`, `use_beta_sigmoid_in_kernel`, `use_gate_in_kernel`), calling
  fla's stage functions past their dispatchers (on NVIDIA no other backend serves these forward stages; with
  TUNED_LAUNCHES the one inside the intra-chunk stage, before its w/u recompute, is peeled too);
- `gated_rms_norm` is fla's gated RMSNorm forward without its autograd.Function and input guard;
- in both, the stages are copies (k3.ops.tuned_launch) whose autotuned kernels launch past Triton's and fla's
  heuristics/autotuner wrappers with the config the autotuner holds for the call's key (a new key is tuned through
  them): the same kernels, configs and grids, without building the key twice and the argument dicts per launch.

These reach into fla's internals, so they run only on the fla series they were written against
(`SUPPORTED_SERIES`); any other version falls back to the public functions, with one log line. The CUDA test
(tests/test_kda_fla_lean.py) checks them against fla's public entries.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging

import torch

__all__ = ["SUPPORTED_SERIES", "CHUNK_SIZE", "ChunkPlan", "lean_supported", "chunk_lists", "chunk_plan",
           "chunk_kda_prefill", "gated_rms_norm", "dense_as"]

SUPPORTED_SERIES = (0, 6)  # fla's (major, minor) whose internals are called here
CHUNK_SIZE = 64  # fla's default KDA chunk (the public entry's, and what the shipped autotune table was made with)
_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def lean_supported(version: str | None = None) -> bool:
    """Whether fla (its installed version, or `version`) is the series these entries were written for; logged
    once when it is not (the callers then use fla's public functions)."""
    if version is None:
        import fla
        version = getattr(fla, "__version__", "0")
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else -1)
    ok = tuple(parts) == SUPPORTED_SERIES
    if not ok:
        _log.warning("fla %s is not the %d.%d series k3's lean inference entries call into: using fla's public "
                     "chunk_kda and rms_norm_gated", version, *SUPPORTED_SERIES)
    return ok


TUNED_LAUNCHES = True  # False: the stages' kernels launch through fla's and Triton's wrappers (a benchmark's baseline)


def _stages() -> dict:
    """fla's forward stages with their dispatch (and input-guard) wrappers peeled off (each costs the host more than
    the launch it wraps, benchmarks/host_cost_kda.py), and with TUNED_LAUNCHES their autotuned kernels launched past
    the heuristics and autotuner wrappers on keys already tuned (k3.ops.tuned_launch)."""
    return _stage_set(TUNED_LAUNCHES)


@functools.lru_cache(maxsize=None)
def _stage_set(tuned: bool) -> dict:
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.gate import fused_beta_sigmoid_fwd
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    fns = dict(l2norm=l2norm_fwd, beta_sigmoid=fused_beta_sigmoid_fwd, gate_cumsum=kda_gate_chunk_cumsum,
               intra=chunk_kda_fwd_intra, states=chunk_gated_delta_rule_fwd_h, output=chunk_gla_fwd_o_gk,
               gated_norm=layer_norm_gated_fwd)
    if not tuned:
        return {name: inspect.unwrap(fn) for name, fn in fns.items()} | {"rcp_ln2": RCP_LN2}
    from k3.ops.tuned_launch import lean_copy
    # the intra stage's w/u recompute sits behind a dispatcher of its own, peeled as the stages' are (its one
    # other backend is Ascend's)
    peel = dict(intra={"recompute_w_u_fwd": None})
    return {name: lean_copy(fn, peel.get(name)) for name, fn in fns.items()} | {"rcp_ln2": RCP_LN2}


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The documents of a packed row cut into chunks of CHUNK_SIZE tokens, as fla's varlen kernels read them:
    `chunk_indices` [NT, 2] (document, chunk within it) and `chunk_offsets` [N+1] (each document's first chunk),
    int64 on the device; `cu_seqlens` the device offsets and `cu_seqlens_cpu` the host ones they came from.
    graph: a fixed-shape plan for CUDA graphs in fla's graph mode (its `use_graph`): trailing empty documents, and
    rows past the real chunks with document −1, on which the chunk kernels return at once."""
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    graph: bool = False

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_cpu.numel() - 1


def chunk_lists(lens: list[int]) -> tuple[list[int], list[int]]:
    """A chunk plan's values on the host for documents of `lens` tokens: the (document, chunk within it) pairs of
    `chunk_indices`, flattened, and `chunk_offsets` (each document's first chunk, then the count)."""
    counts = [-(-n // CHUNK_SIZE) for n in lens]
    pairs = [v for doc, c in enumerate(counts) for within in range(c) for v in (doc, within)]
    return pairs, [0, *itertools.accumulate(counts)]


_last_plan: list = [None, None, None]  # (cu_seqlens, cu_seqlens_cpu, plan) of the last call: one step's layers


def chunk_plan(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkPlan:
    """The chunk plan of `cu_seqlens` (int64 on the device), built on the host from `cu_seqlens_cpu` (its values;
    read back from the device when not given, one wait) and sent in one non-blocking copy. The last plan is kept
    with the two tensors themselves: a serving step passes the same two objects to every layer, so it is built once
    a step (neither tensor may be changed in place afterwards, as fla's own cache assumes)."""
    if _last_plan[0] is cu_seqlens and _last_plan[1] is cu_seqlens_cpu and cu_seqlens_cpu is not None:
        return _last_plan[2]
    host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).to("cpu", torch.int64)
    # built from Python lists: torch's CPU ops on these few values cost up to ~0.6 ms each on the H200's host
    cu = host.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if not lens or min(lens) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing offsets of >= 1 documents, got {cu}")
    pairs, offsets = chunk_lists(lens)
    flat = torch.tensor(pairs + offsets, dtype=torch.long, pin_memory=cu_seqlens.device.type == "cuda")
    # pinned: the copy leaves without waiting for the queued kernels
    flat = flat.to(cu_seqlens.device, non_blocking=True)
    nt = len(pairs) // 2
    plan = ChunkPlan(cu_seqlens, host, flat[:2 * nt].view(-1, 2), flat[2 * nt:])
    _last_plan[:] = [cu_seqlens, cu_seqlens_cpu, plan]
    return plan


def chunk_kda_prefill(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound: float, scale: float | None = None,
                      initial_state: torch.Tensor | None = None, output_final_state: bool = True,
                      plan: ChunkPlan | None = None,
                      qk_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunked KDA forward with the gate, the q/k L2 norms and the beta sigmoid fused, for inference only.

    Arguments as `k3.ops.kda_fla.fla_kda_gated` (q, k raw; f the gate projection; beta_logits before the sigmoid;
    A_log [H] and dt_bias [H*K] fp32; initial_state [N, H, K, V] fp32 contiguous), all of one dtype and
    contiguous; `plan` the documents of a packed row (B == 1), None for dense rows; `qk_normalized`: q and k come
    L2-normalised (the norms skipped). Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 or
    None)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, f, beta_logits, A_log, dt_bias)):
        raise ValueError("chunk_kda_prefill is inference only: call it under torch.inference_mode or no_grad")
    st = _stages()
    BT, scale = CHUNK_SIZE, q.shape[-1] ** -0.5 if scale is None else scale
    cu, indices = (None, None) if plan is None else (plan.cu_seqlens, plan.chunk_indices)
    if not qk_normalized:
        q, _ = st["l2norm"](q)
        k, _ = st["l2norm"](k)
    beta = st["beta_sigmoid"](beta_logits)
    # the stages of fla 0.6's chunk_kda_fwd (use_gate_in_kernel, safe_gate, keys-first states), in its order:
    # the bounded gate with its chunk-local cumsum (in log2 units), the intra-chunk factors with the triangular
    # solve (w, u, gated keys, Aqk), the chunk-boundary states, then the output
    graph = plan is not None and plan.graph  # the chunk kernels skip the plan's sentinel rows
    g = st["gate_cumsum"](g=f, A_log=A_log, dt_bias=dt_bias, scale=st["rcp_ln2"], chunk_size=BT, cu_seqlens=cu,
                          chunk_indices=indices, lower_bound=float(lower_bound), use_graph=graph)
    w, u, _, kg, Aqk, _ = st["intra"](q=q, k=k, v=v, gk=g, beta=beta, scale=scale, cu_seqlens=cu, chunk_size=BT,
                                      chunk_indices=indices, safe_gate=True, use_graph=graph)
    h, v_new, final_state = st["states"](
        k=kg, w=w, u=u, gk=g, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu,
        cu_seqlens_cpu=None if plan is None else plan.cu_seqlens_cpu, chunk_indices=indices,
        chunk_offsets=None if plan is None else plan.chunk_offsets, chunk_size=BT, state_v_first=False)
    o = st["output"](q=q, v=v_new, g=g, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=BT, chunk_indices=indices,
                     state_v_first=False, use_graph=graph)
    return o.to(q.dtype), final_state


def dense_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` and contiguous: t itself where it already is. A no-op `.to` or `.contiguous` still costs the
    host a dispatch each (~7 µs a pair on the CPU harness), a dozen per KDA layer of a serving step."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def gated_rms_norm(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(o, weight) ⊙ sigmoid(g)` over the last dim by fla's gated-norm forward kernel (inference only):
    what `fla_output_gate` computes, without the autograd.Function around it."""
    shape = o.shape
    rows = [dense_as(t.reshape(-1, shape[-1]), t.dtype) for t in (o, g)]
    y, *_ = _stages()["gated_norm"](*rows, dense_as(weight, weight.dtype), None, activation="sigmoid", eps=eps,
                                    is_rms_norm=True)
    return y.view(shape)
