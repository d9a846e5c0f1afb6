"""Expert parallelism for serving: a rank keeps only its home experts (`owned_experts`, read by rank-sharded
loading, MXFP4 kept packed) and computes their share of every token's routed sum; one all-reduce over the EP
group adds the shares. Every rank holds the whole batch (replicated or tensor-parallel attention), so no token
moves between ranks: the combine is a sum of [N, latent] partials, with no host read while a CUDA graph
captures (the training `ExpertParallelCombine` reads its all-to-all splits on the host every layer and cannot
be captured)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from k3.checkpoint.convert import config_experts_format
from k3.checkpoint.sharded import RankLayout, load_rank_shard
from k3.config import K3Config
from k3.model.moe import LatentMoE

MODES = ("auto", "masked", "sparse")


class ExpertShardCombine:
    """Drop-in for `LatentMoE.combine_experts(z, idx, w)` on a rank that holds experts `first .. first+count-1`.

    z: [N, L]; idx: [N, k] global expert ids; w: [N, k]. Returns the full routed sum r: [N, L] after the
    all-reduce over `group` (None: this rank's partial sum only). Two ways to compute the partial sum:
    `sparse` runs only the slots routed here (reads their count on the host: prefill, CPU); `masked` runs all
    N·k slots with other ranks' slots weighted 0 (fixed shapes, no host read: what a CUDA-graph capture
    takes). `auto`: masked while capturing, sparse otherwise."""

    def __init__(self, moe: LatentMoE, first: int, group=None, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.first, self.group, self.mode = first, group, mode
        e = moe.experts
        self.count = (e.w1_packed if e.packed else e.w1).shape[0]
        # what LatentMoE.combine_experts reads, over the local experts only (one home for the expert dispatch)
        self.local = SimpleNamespace(experts=e, num_experts=self.count, qat=moe.qat, betas=moe.betas)

    def __call__(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        r = self.partial(z, idx, w)
        if self.group is not None:
            dist.all_reduce(r, group=self.group)
        return r

    def partial(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        local = idx - self.first
        mine = (local >= 0) & (local < self.count)
        capturing = z.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.mode == "masked" or (self.mode == "auto" and capturing):
            # other ranks' slots run through local expert 0 with weight 0: finite values times an exact zero
            return LatentMoE.combine_experts(self.local, z, torch.where(mine, local, 0), torch.where(mine, w, 0))
        N, k = idx.shape
        slots = mine.flatten().nonzero().squeeze(1)  # the host learns how many slots are here
        r = z.new_zeros(N, z.shape[1])
        if slots.numel() == 0:
            return r
        tokens = slots // k
        y = LatentMoE.combine_experts(self.local, z[tokens], local.flatten()[slots, None], w.flatten()[slots, None])
        return r.index_add_(0, tokens, y)


def load_rank_model(path, layout: RankLayout, device="cpu", dtype=None, ep_group=None, tp_group=None,
                    packed_experts: bool | None = None, mode: str = "auto"):
    """The K3ForCausalLM of one serving rank: its TP block of every non-expert tensor (`tp_group`; None: whole)
    and of the routed experts only the EP rank's own (read by `load_rank_shard`, nothing else materialised), each
    LatentMoE combining over `ep_group`. packed_experts: keep MXFP4 experts packed (default: when the checkpoint
    stores them so)."""
    from k3.parallel.tensor_parallel import model_from_rank_shard

    config = K3Config.from_pretrained(Path(path))
    if packed_experts is None:
        packed_experts = config_experts_format(config) == "mxfp4"
    shard = load_rank_shard(path, layout, device=device, dtype=dtype, packed_experts=packed_experts)
    model = model_from_rank_shard(config, shard, tp_group)
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        moe.combine_experts = ExpertShardCombine(moe, shard.experts.start, ep_group, mode)
    return model.eval()
