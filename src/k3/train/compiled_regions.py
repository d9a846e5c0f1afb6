"""Opt-in compiled regions of the training step (`TrainConfig.compile`, `k3 train --compile`).

Compiled: every KDA and MLA mixer, LatentMoE (router, dispatch plan, expert GEMMs, slot-order sum, shared experts)
and dense MLP, through one torch.compile'd function per kind that every layer of that kind shares: the function is
the class's forward and the layer its first argument, so Dynamo guards on the layer's configuration, never on which
layer it is (16 layers, four graphs). fullgraph=True: a graph break is an error, not a silent split. Inside a
region k3's training Triton kernels step aside (`triton_dispatch.use_triton` is False while compiling) and inductor
fuses their plain-PyTorch paths with the casts, gates and gathers around them; SDPA and `_grouped_mm` stay single
calls, as do custom ops (`use_triton_op`). KDA's short convs and core, which Dynamo cannot trace (the conv's
backward recomputes through autograd.grad; the core plans packed documents on the host, fla's on its own), are
custom ops with their autograd (k3.ops.kda_train_ops): the region holds its projections, gates, norms and casts
around them.

Left eager by design: the AttnRes mixes between the regions. A mix reads every block so far (a region holding it
would take a list that grows each block: a graph per length), and on CUDA its Triton kernels sum each block's
gradient into one BlockGrads buffer across all the mixes that read it (Python state per backward pass, which no
traced backward can hold: inductor would leave autograd to add one gradient per reader). Only training forwards
take a region (module in training mode, gradients on, no decode cache or context-parallel layout): evaluation and
generation stay eager, as do expert-parallel MoE layers, whose `combine_experts` exchanges tokens between processes
(such a run is refused in TrainConfig.validate).

Made for CUDA, where the autocast step's expert GEMMs are bf16 `_grouped_mm` calls in the graph. On the CPU the
fp32 grouped GEMM has no traceable form, so a compiled MoE gathers each row's expert weights
(`grouped_mm.rows_linear`): correct (the tests run there) but slower than eager (tiny, 16x256 on 2 busy cores:
16.5 s a step against 6.9 s eager, 47 s for the first, compiling).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.model.mlp import SiTUMLP
from k3.model.moe import LatentMoE
from k3.ops.kda_train_ops import kda_core_train, kda_short_conv

KINDS = (KimiDeltaAttention, MultiHeadLatentAttention, LatentMoE, SiTUMLP)

# A kind compiles once with the shapes it first sees and, when they change, once more with dynamic shapes;
# anything past that is a guard that should not exist (on a layer, say), so it raises instead of running eagerly.
RECOMPILE_LIMIT = 2


def compile_regions(model: nn.Module, backend="inductor", recompile_limit: int = RECOMPILE_LIMIT) -> list[nn.Module]:
    """Route the training forwards of `model`'s KDA and MLA mixers, MoE layers and dense MLPs (a K3ForCausalLM, or
    anything holding its decoder `model.layers`) through compiled functions, one per kind; returns the modules.
    backend: torch.compile's (tests pass a recording one). Parameters, names and checkpoints are unchanged."""
    layers = model.model.layers
    if backend == "inductor" and model.lm_head.weight.device.type == "cpu":
        _check_cpu_compiler()
    compiled: dict[type, object] = {}
    regions = []
    for layer in layers:
        for module in (layer.self_attn, getattr(layer, "block_sparse_moe", None), getattr(layer, "mlp", None)):
            if not isinstance(module, KINDS):
                continue  # the absent one of moe/mlp
            if "combine_experts" in vars(module):
                continue  # expert parallelism's exchange between processes (k3.parallel.expert_parallel)
            if "forward" in vars(module):
                raise ValueError(f"{type(module).__name__} of layer {layer.layer_idx} already has its own forward "
                                 f"(compile_regions applied twice?)")
            kind = _plain_class(module)
            if kind not in compiled:
                compiled[kind] = torch.compile(_TRACED.get(kind, kind.forward), fullgraph=True, backend=backend)
            module.forward = types.MethodType(_dispatch(kind.forward, compiled[kind], recompile_limit), module)
            regions.append(module)
    return regions


def _check_cpu_compiler() -> None:
    """Inductor builds CPU kernels with a C++ compiler: without one, say so now rather than at the first step."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # (a private helper: where it moved, inductor reports a missing compiler itself)
        return
    try:
        get_cpp_compiler()
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--compile on the CPU needs a C++ compiler for inductor's kernels (g++, or $CXX): "
                         f"{reason}") from None


def _plain_class(module: nn.Module) -> type:
    """The model's own class of `module` (FSDP2's fully_shard swaps in a subclass of it)."""
    return next(c for c in type(module).__mro__ if c in KINDS)


class _OpaqueKDALayout:
    """A KDA training forward's layout inside a region: rows from no state (packed documents where doc_ids), the
    short convs and the core each one custom op (k3.ops.kda_train_ops) that the graph keeps as a call."""

    def __init__(self, doc_ids: torch.Tensor | None):
        self.doc_ids = doc_ids

    def short_convs(self, m: KimiDeltaAttention, xs: list[torch.Tensor]):
        return [kda_short_conv(x, conv.weight, self.doc_ids, True) for x, conv in zip(xs, m.convs)], [None] * 3

    def core(self, m: KimiDeltaAttention, q, k, v, f, beta_logits, tails) -> torch.Tensor:
        return kda_core_train(q, k, v, f, beta_logits, m.A_log, m.dt_bias, m.lower_bound, self.doc_ids)


def _kda_training_forward(self: KimiDeltaAttention, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                          cache=None) -> torch.Tensor:
    """KimiDeltaAttention.forward through the opaque layout (the dispatch sends only cache=None here) where Dynamo
    traces it; run eagerly (torch.compiler.set_stance("force_eager"), the benchmark's eager rows) the plain forward
    (whose core's backward does not run the core's forward once more, as the op's does)."""
    if not torch.compiler.is_compiling():
        return KimiDeltaAttention.forward(self, x, doc_ids, cache)
    return KimiDeltaAttention.forward(self, x, doc_ids, cache=_OpaqueKDALayout(doc_ids))


# what a kind's region traces, where it is not the class's forward
_TRACED = {KimiDeltaAttention: _kda_training_forward}


def _dispatch(eager, compiled, recompile_limit: int):
    """A forward that takes the compiled function in a training forward, the eager one otherwise."""
    def forward(self, *args, **kwargs):
        # (a mixer's cache is its third argument; the MoE's and MLP's forwards take two at most)
        if self.training and torch.is_grad_enabled() and kwargs.get("cache") is None and len(args) < 3:
            with torch._dynamo.config.patch(recompile_limit=recompile_limit, fail_on_recompile_limit_hit=True):
                return compiled(self, *args, **kwargs)
        return eager(self, *args, **kwargs)
    return forward

