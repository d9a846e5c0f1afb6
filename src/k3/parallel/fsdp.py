"""FSDP2 (`fully_shard`) for the non-expert parameters, over all ranks of the mesh. Expert shards stay plain
tensors (expert parallelism already splits them; their copies are summed over the edp group instead).

Units are the modules whose `__call__` actually runs (FSDP2 gathers parameters in a module's forward
pre-hook): every mixer, every MoE / dense MLP, the embedding and the LM head, then the root for the rest
(norms and AttnRes weights that the decoder reads directly).
"""
from __future__ import annotations

from torch import nn

from k3.model.decoder import K3ForCausalLM
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.model.mlp import SiTUMLP
from k3.model.moe import LatentMoE


def apply_fsdp(model: K3ForCausalLM, mesh, reshard_after_forward: bool = True) -> None:
    """Shard the dense parameters of `model` over `mesh.device_mesh()` in place. The ranks' losses are
    already scaled to sum to the global mean, so gradients are summed (divide factor 1), not averaged."""
    from torch.distributed.fsdp import fully_shard

    device_mesh = mesh.device_mesh()
    experts = {p for n, p in model.named_parameters() if ".experts.w" in n}
    units = [m for m in model.modules()
             if isinstance(m, (KimiDeltaAttention, MultiHeadLatentAttention, LatentMoE))
             or (isinstance(m, SiTUMLP) and not _inside_moe(model, m))]
    units += [model.model.embed_tokens, model.lm_head]
    for unit in units:
        fully_shard(unit, mesh=device_mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=experts & set(unit.parameters()) or None)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=False, ignored_params=experts or None)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            # a plain SUM: with factor 1 FSDP2 would otherwise ask float32 reduce-scatters for
            # PREMUL_SUM(1.0), which gloo does not implement
            m.set_force_sum_reduction_for_comms(True)


def _inside_moe(model: nn.Module, module: nn.Module) -> bool:
    return any(isinstance(m, LatentMoE) and module in m.modules() for m in model.modules())


def full_gradients(model: nn.Module) -> dict:
    """name → full gradient tensor (DTensor shards gathered), for checks and logging."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out
