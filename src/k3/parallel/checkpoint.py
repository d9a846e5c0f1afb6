"""Checkpoints of a parallelized model: the full (single-process) state dict goes back into expert and FSDP
shards, and each rank's optimizer state is saved as plain local tensors and rewrapped on load.

The optimizer state is kept per rank rather than gathered: every rank's moments belong to exactly the
parameter shards it holds, so a resume with the same layout is exact and no rank ever holds all of it.
"""
from __future__ import annotations

import torch

from k3.parallel.expert_parallel import is_expert_param


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def layout(runner) -> dict:
    """What must match for a rank's saved optimizer state to fit this process: the mesh and the sharding."""
    d = runner.mesh.dims
    return {"dp": d.dp, "ep": d.ep, "cp": d.cp, "fsdp": bool(runner.fsdp)}


@torch.no_grad()
def load_full_state_dict(runner, state: dict) -> None:
    """Copy a full single-process state dict (name → tensor, e.g. the rank-0 checkpoint) into `runner.model`:
    expert rows [E, ...] sliced to this rank's E/ep, FSDP parameters cut to this rank's shard, the rest
    copied whole. Not a collective. Raises ValueError naming missing or unexpected tensors."""
    model = runner.model
    for m in model.modules():  # FSDP2 units left unsharded by a forward: the DTensor shards are the parameters
        if hasattr(m, "reshard") and hasattr(m, "unshard"):
            m.reshard()
    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ep, ep_rank = runner.mesh.dims.ep, runner.mesh.ep_rank
    from torch.distributed.tensor import distribute_tensor
    for name, t in targets.items():
        full = state[name].to(device=t.device, dtype=t.dtype)
        if _is_dtensor(t):
            # src_data_rank=None: every rank already holds the full tensor, so each cuts its own shard
            shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(shard.to_local())
        elif is_expert_param(name) and ep > 1:
            per = full.shape[0] // ep
            t.copy_(full[ep_rank * per:(ep_rank + 1) * per])
        else:
            t.copy_(full)


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with every DTensor (the state of an FSDP-sharded parameter) replaced by this
    rank's local shard, so that it pickles without the device mesh."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: (v.to_local() if _is_dtensor(v) else v) for k, v in s.items()}
                   for i, s in sd["state"].items()}
    return sd


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Inverse of `local_optimizer_state`: load, then wrap each state tensor of a DTensor parameter back into a
    DTensor with the parameter's mesh, placements and global shape (the update mixes the two)."""
    optimizer.load_state_dict(sd)
    from torch.distributed.tensor import DTensor
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not _is_dtensor(p) or p not in optimizer.state:
                continue
            local_shape = p.to_local().shape
            state = optimizer.state[p]
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == local_shape and v.dim() > 0:
                    state[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
