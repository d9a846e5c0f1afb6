"""Expert parallelism for LatentMoE, applied from outside: each rank of an EP group keeps E/R experts, and
the layer's `combine_experts` (the seam between routing and the expert GEMMs) is replaced by a dispatch →
expert GEMMs → combine over `all_to_all_single`, at the latent width (z is hidden/2 wide).

Two modes. `plain`: each slot goes to its expert's home rank. `balanced` (MoonEP): a per-layer plan from the
all-gathered loads, computed on the device (k3.parallel.planner), gives every rank the same number of slots;
ranks that process another rank's experts fetch those weights first (one all-to-all of packed w1|w3|w2),
and autograd sends the replica gradients back the same way, where they add into the home expert's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3.model.moe import LatentMoE
from k3.ops.grouped_mm import expert_situ_mlp
from k3.ops.token_permute import dispatch_rows, inverse_permutation, permute_rows
from k3.parallel.comm import all_gather, all_to_all
from k3.parallel.planner import ExpertPlan, PlanTensors, balanced_plan, plain_plan

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
    Per layer: one small all-gather of the expert counts, the plan on the device (k3.parallel.planner's
    PlanTensors: every rank derives its send and receive splits from the gathered counts, so no split
    exchange), one read of those splits to the host (all_to_all_single takes host lists), then the replica
    weight fetch (balanced plans with replicas only), the dispatch and the combine all-to-alls.
    `last_plan` is the most recent plan as an ExpertPlan (built on demand, for tests and benchmarks).
    """

    def __init__(self, moe: LatentMoE, group, mode: str = "balanced"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.moe, self.group, self.mode = moe, group, mode
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.last_plan_tensors: PlanTensors | None = None

    @property
    def last_plan(self) -> ExpertPlan | None:
        return None if self.last_plan_tensors is None else self.last_plan_tensors.to_plan()

    def __call__(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, meanwhile=None):
        """meanwhile: LatentMoE's shared-expert MLP, called while the dispatch all-to-all is in flight, so its
        GEMMs overlap the transfer; then (r, its result) is returned instead of r."""
        R, me, E = self.size, self.rank, self.moe.num_experts
        N, k = idx.shape
        dev = z.device
        flat = idx.flatten()
        counts = _count(flat, E)
        all_counts = all_gather(counts[None], self.group)  # [R, E], stays on the device
        plan = (balanced_plan if self.mode == "balanced" else plain_plan)(all_counts.sum(0), R)
        self.last_plan_tensors = plan
        received = plan.received(all_counts, me)  # [R, E]
        # the one host read of the layer: splits and replica counts for the all_to_all_single calls
        host = torch.cat([plan.sent(all_counts, me), received.sum(1), plan.replica_mask.sum(1), plan.donor]).tolist()
        send_splits, recv_splits, n_replicas, donor = (host[i * R:(i + 1) * R] for i in range(4))

        # each local slot's position on the global slot axis → the rank that processes it
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        local_start = torch.cumsum(counts, 0) - counts
        first = (torch.cumsum(plan.load, 0) - plan.load) + (torch.cumsum(all_counts, 0) - all_counts)[me]
        pos = first[sorted_e] + torch.arange(N * k, device=dev) - local_start[sorted_e]
        by_dest = torch.argsort(plan.slot_ranks(pos), stable=True)
        send_slots = order[by_dest]  # slot ids (token·k + j) in send order: by destination, then expert
        unsend = inverse_permutation(send_slots)
        pending = []  # the dispatch and the replica fetch travel while the shared experts compute
        x_recv = all_to_all(dispatch_rows(z, send_slots, unsend, k), recv_splits, send_splits, self.group, pending)
        fetched = self._fetch_replicas(plan, n_replicas, donor, pending)
        extra = meanwhile() if meanwhile is not None else None
        for work in pending:
            work.wait()
        # the arrivals' experts follow from the plan: by source rank, then expert
        e_recv = torch.repeat_interleave(torch.arange(E, device=dev).repeat(R), received.flatten(),
                                         output_size=sum(recv_splits))

        w1, w3, w2, table = self._weights(plan, n_replicas, fetched)
        row_of = torch.full((E,), -1, dtype=torch.long, device=dev)
        row_of[table] = torch.arange(table.numel(), device=dev)
        rows = row_of[e_recv]
        by_row = torch.argsort(rows, stable=True)
        gemm = expert_situ_mlp
        if getattr(self.moe, "qat", False):  # MXFP4/MXFP8 fake-quant on the fetched weights too
            from k3.ops.mx_experts import qat_expert_situ_mlp as gemm
        arrival = inverse_permutation(by_row)
        y = gemm(permute_rows(x_recv, by_row, arrival), _count(rows, table.numel()),
                 w1, w3, w2, *self.moe.betas)
        y_back = all_to_all(permute_rows(y, arrival, by_row), send_splits, recv_splits, self.group)
        # as LatentMoE.combine_experts: back to [N, k] slot order, then one weighted sum over the k choices
        r = torch.bmm(w.unsqueeze(1), permute_rows(y_back, unsend, send_slots).view(N, k, -1)).squeeze(1)
        return r if meanwhile is None else (r, extra)

    def _fetch_replicas(self, plan: PlanTensors, n_replicas: list[int], donor: list[int], pending: list):
        """Launch the exchange of replica weights (packed w1|w3|w2 rows) and return its destination, or None
        when the plan has no replicas. n_replicas, donor: the plan's per-rank replica counts and donors, on the
        host. The result is complete once the work appended to `pending` is waited on."""
        if not any(n_replicas):  # the plan is global, so every rank skips the fetch together
            return None
        e = self.moe.experts
        R, me, per = self.size, self.rank, e.count
        send_counts = [n_replicas[j] if donor[j] == me else 0 for j in range(R)]
        # rows for the ranks that replicate my experts: by taker, then expert (first n true entries, no sync)
        wanted = plan.replica_mask[:, e.first:e.first + per] & (plan.donor == me)[:, None]
        send_rows = torch.argsort((~wanted).flatten().to(torch.int8), stable=True)[:sum(send_counts)] % per
        packed = torch.cat([w[send_rows].flatten(1) for w in (e.w1, e.w3, e.w2)], dim=1)  # rows that leave: [n, P]
        return all_to_all(packed, [n_replicas[me] if j == donor[me] else 0 for j in range(R)], send_counts,
                          self.group, pending)

    def _weights(self, plan: PlanTensors, n_replicas: list[int], fetched: torch.Tensor | None):
        """Stacked (w1, w3, w2) for the local experts followed by this rank's fetched replicas, and their
        global ids."""
        e = self.moe.experts
        own = (e.w1, e.w3, e.w2)
        home = torch.arange(e.first, e.first + e.count, device=e.w1.device)
        if fetched is None:
            return (*own, home)
        parts = fetched.split([w[0].numel() for w in own], dim=1)
        w1, w3, w2 = (torch.cat([w, f.reshape(-1, *w.shape[1:])]) for w, f in zip(own, parts))
        mine = torch.argsort((~plan.replica_mask[self.rank]).to(torch.int8), stable=True)[:n_replicas[self.rank]]
        return w1, w3, w2, torch.cat([home, mine])


def _count(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] occurrences of each id (not bincount: on CUDA it reads the max back to the host)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


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
