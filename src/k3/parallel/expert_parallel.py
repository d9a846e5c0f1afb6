"""Expert parallelism for LatentMoE, applied from outside: each rank of an EP group keeps E/R experts, and
the layer's `combine_experts` (the seam between routing and the expert GEMMs) is replaced by a dispatch →
expert GEMMs → combine over `all_to_all_single`, at the latent width (z is hidden/2 wide).

Two modes. `plain`: each slot goes to its expert's home rank. `balanced` (MoonEP): a per-layer plan from the
all-gathered loads (k3.parallel.planner) gives every rank the same number of slots; ranks that process
another rank's experts fetch those weights first (one all-to-all of packed w1|w3|w2), and autograd sends the
replica gradients back the same way, where they add into the home expert's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3.model.moe import LatentMoE
from k3.ops.grouped_mm import expert_situ_mlp
from k3.ops.token_permute import dispatch_rows, inverse_permutation, permute_rows
from k3.parallel.comm import all_gather, all_to_all
from k3.parallel.planner import ExpertPlan, plan_balanced, plan_plain

MODES = ("balanced", "plain")


class LocalExperts(nn.Module):
    """This rank's slice of the stacked experts: w1, w3: [E/R, I, L]; w2: [E/R, L, I]; experts
    `first .. first + E/R − 1` in global numbering. Same attribute names as k3.model.moe.Experts."""

    def __init__(self, experts: nn.Module, first: int, count: int):
        super().__init__()
        self.first, self.count = first, count
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            setattr(self, name, nn.Parameter(full.detach()[first:first + count].clone(),
                                             requires_grad=full.requires_grad))


class ExpertParallelCombine:
    """Drop-in for `LatentMoE.combine_experts(z, idx, w)` over an EP process group.

    z: [N, L] latent tokens; idx: [N, k] global expert ids; w: [N, k] combine weights. Returns r: [N, L].
    `last_plan` keeps the most recent ExpertPlan (for tests and benchmarks).
    """

    def __init__(self, moe: LatentMoE, group, mode: str = "balanced"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.moe, self.group, self.mode = moe, group, mode
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.last_plan: ExpertPlan | None = None

    def __call__(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        R, me, E = self.size, self.rank, self.moe.num_experts
        N, k = idx.shape
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=E)
        all_counts = all_gather(counts[None], self.group).cpu()  # [R, E]
        load = all_counts.sum(0)
        plan = (plan_balanced if self.mode == "balanced" else plan_plain)(load, R)
        self.last_plan = plan

        # each local slot's position on the global slot axis → the rank that processes it
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        dev = z.device
        local_start = (torch.cumsum(counts, 0) - counts)
        expert_base = (torch.cumsum(load, 0) - load).to(dev)
        src_offset = all_counts[:me].sum(0).to(dev)
        pos = expert_base[sorted_e] + src_offset[sorted_e] + torch.arange(N * k, device=dev) - local_start[sorted_e]
        dest = plan.slot_ranks(pos.cpu()).to(dev)
        by_dest = torch.argsort(dest, stable=True)
        send_slots = order[by_dest]  # slot ids (token·k + j) in send order
        send_splits = torch.bincount(dest, minlength=R).cpu()
        recv_splits = all_to_all(send_splits.to(dev), [1] * R, [1] * R, self.group).cpu().tolist()
        send_splits = send_splits.tolist()

        unsend = inverse_permutation(send_slots)
        x_recv = all_to_all(dispatch_rows(z, send_slots, unsend, k), recv_splits, send_splits, self.group)
        e_recv = all_to_all(flat[send_slots], recv_splits, send_splits, self.group)

        w1, w3, w2, table = self._weights(plan)
        row_of = torch.full((E,), -1, dtype=torch.long, device=dev)
        row_of[table.to(dev)] = torch.arange(table.numel(), device=dev)
        rows = row_of[e_recv]
        by_row = torch.argsort(rows, stable=True)
        gemm = expert_situ_mlp
        if getattr(self.moe, "qat", False):  # MXFP4/MXFP8 fake-quant on the fetched weights too
            from k3.ops.mx_experts import qat_expert_situ_mlp as gemm
        arrival = inverse_permutation(by_row)
        y = gemm(permute_rows(x_recv, by_row, arrival), torch.bincount(rows, minlength=table.numel()),
                 w1, w3, w2, *self.moe.betas)
        y_back = all_to_all(permute_rows(y, arrival, by_row), send_splits, recv_splits, self.group)
        # as LatentMoE.combine_experts: back to [N, k] slot order, then one weighted sum over the k choices
        return torch.bmm(w.unsqueeze(1), permute_rows(y_back, unsend, send_slots).view(N, k, -1)).squeeze(1)

    def _weights(self, plan: ExpertPlan):
        """Stacked (w1, w3, w2) for the local experts followed by this rank's replicas, and their global ids."""
        e = self.moe.experts
        R, me, per = self.size, self.rank, e.count
        home = torch.arange(e.first, e.first + per)
        if not plan.has_replicas:  # the plan is global, so every rank skips the fetch together
            return e.w1, e.w3, e.w2, home
        shapes = [e.w1.shape[1:], e.w3.shape[1:], e.w2.shape[1:]]
        packed = torch.cat([e.w1.flatten(1), e.w3.flatten(1), e.w2.flatten(1)], dim=1)  # [per, P]
        wanted = [[g - e.first for g in plan.replicas[j]] if plan.donor[j] == me else [] for j in range(R)]
        send_rows = torch.tensor([i for lst in wanted for i in lst], dtype=torch.long, device=packed.device)
        mine = plan.replicas[me]
        fetched = all_to_all(packed[send_rows], [len(mine) if j == plan.donor[me] else 0 for j in range(R)],
                             [len(lst) for lst in wanted], self.group)
        stacked = torch.cat([packed, fetched], dim=0)
        sizes = [s.numel() for s in shapes]
        w1, w3, w2 = (t.reshape(-1, *s) for t, s in zip(stacked.split(sizes, dim=1), shapes))
        return w1, w3, w2, torch.cat([home, torch.tensor(mine, dtype=torch.long)])


def owned_experts(num_experts: int, rank: int, size: int) -> range:
    """The home experts of EP rank `rank` of `size`: a contiguous block of num_experts / size (the one rule,
    used by training and by rank-sharded checkpoint loading)."""
    if num_experts % size:
        raise ValueError(f"expert parallel size {size} must divide the number of routed experts {num_experts}")
    if not 0 <= rank < size:
        raise ValueError(f"expert parallel rank {rank} is outside 0..{size - 1}")
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def apply_expert_parallel(model: nn.Module, group, mode: str = "balanced") -> list[ExpertParallelCombine]:
    """Keep this rank's E/R experts of every LatentMoE in `model` and route its expert work over `group`.

    The model must hold the full experts (e.g. the same seeded init on every rank); parameter names stay
    `...experts.w1` etc., now with E/R rows. Returns the per-layer combine handles.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    R, me = dist.get_world_size(group), dist.get_rank(group)
    handles = []
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        if getattr(moe.experts, "packed", False):
            raise ValueError("expert parallelism shards trainable experts; MXFP4-packed (serving) experts are not supported")
        mine = owned_experts(moe.num_experts, me, R)
        moe.experts = LocalExperts(moe.experts, mine.start, len(mine))
        handle = ExpertParallelCombine(moe, group, mode)
        moe.combine_experts = handle  # instance attribute shadows the method: the model code is untouched
        handles.append(handle)
    return handles


def is_expert_param(name: str) -> bool:
    """Parameters sharded by expert parallelism (their gradients are summed over copies, not all ranks)."""
    return ".experts.w" in name
