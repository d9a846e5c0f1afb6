"""The process layout: data × context parallel ranks (context innermost), expert parallel groups cut from
consecutive ranks, and the launch checks that turn a bad `--dp/--ep/--cp` into a clear message."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """dp × cp = world size; ep consecutive ranks share one copy of the experts (ep divides the world)."""
    dp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def validate(self, world_size: int | None = None, num_experts: int | None = None,
                 seq_len: int | None = None) -> "ParallelDims":
        for name in ("dp", "ep", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {v!r}")
        if world_size is not None and self.dp * self.cp != world_size:
            raise ValueError(f"--dp {self.dp} × --cp {self.cp} = {self.dp * self.cp} must equal the number of "
                             f"processes (--nproc / world size) {world_size}")
        if self.world_size % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the world size dp×cp = {self.world_size} "
                             f"(expert groups are cut from consecutive ranks)")
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the number of routed experts {num_experts}")
        if seq_len is not None and self.cp > seq_len:
            raise ValueError(f"--cp {self.cp} is larger than the sequence length {seq_len}: every context "
                             f"parallel rank needs at least one token")
        return self


def init_distributed(timeout_s: float = 300.0, device_type: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment):
    NCCL for CUDA tensors (and this rank's GPU, LOCAL_RANK, made current), gloo for CPU ones. device_type:
    where the run's tensors live (default: CUDA when there is a GPU). Returns (rank, world_size)."""
    if not dist.is_initialized():
        from datetime import timedelta
        on_gpu = torch.cuda.is_available() if device_type is None else device_type == "cuda"
        backend = "nccl" if on_gpu else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


class ParallelMesh:
    """Process groups of one launch. rank = d·cp + c. Groups (each a list of global ranks):
    cp: same d (one sequence's shards); dp: same c; ep: `rank // ep` (one full set of experts);
    edp: same `rank % ep` (the copies of one expert shard, whose gradients are summed)."""

    def __init__(self, dims: ParallelDims):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs an initialised torch.distributed process group "
                               "(launch with torchrun or call init_distributed())")
        self.dims = dims.validate(world_size=dist.get_world_size())
        self.rank = dist.get_rank()
        dp, cp, ep, world = dims.dp, dims.cp, dims.ep, dims.world_size
        self.dp_rank, self.cp_rank = divmod(self.rank, cp)
        self.ep_rank = self.rank % ep
        # new_group is collective: every rank creates every group in the same order
        self.cp_group = self._pick([[d * cp + c for c in range(cp)] for d in range(dp)])
        self.dp_group = self._pick([[d * cp + c for d in range(dp)] for c in range(cp)])
        self.ep_group = self._pick([[g * ep + i for i in range(ep)] for g in range(world // ep)])
        self.edp_group = self._pick([[g * ep + i for g in range(world // ep)] for i in range(ep)])
        self._device_mesh = None

    def _pick(self, rank_lists):
        mine = None
        for ranks in rank_lists:
            g = dist.new_group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    def device_mesh(self):
        """A 1-D DeviceMesh over all ranks (FSDP2 shards the non-expert parameters over it)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            kind = "cuda" if torch.cuda.is_available() else "cpu"
            self._device_mesh = init_device_mesh(kind, (self.dims.world_size,), mesh_dim_names=("fsdp",))
        return self._device_mesh
