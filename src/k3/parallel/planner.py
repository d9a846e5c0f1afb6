"""MoonEP's balanced expert plan (SPEC §5): from one layer's global expert loads, decide which rank processes
each token-slot so that every rank gets the same number of slots, by placing redundant replicas of an
overloaded rank's experts on other ranks.

Slots are laid on one global axis: expert 0's slots, then expert 1's, … (within an expert: by source rank,
then source order). Experts are homed in contiguous blocks of E/R, so rank h's home slots are one range of
that axis. A plan cuts the axis into segments, each processed by one rank.

Construction (every rank ends with exactly its capacity C_r = ⌊N/R⌋ or ⌈N/R⌉):
donors (home load above capacity) in decreasing excess; receivers (below) in rank order. A donor hands
whole receiver deficits to receivers while its remaining excess covers them; when what is left is smaller
than the next receiver's deficit, the next donor takes that remainder as replicas instead (a relay) and
hands it on with its own excess. A receiver takes from one donor, a relay donor from the one before it, so
every rank takes replicas from at most one other rank, hence at most E/R redundant experts. A relayed
remainder is below a receiver's deficit ≤ its capacity ≤ the relay's capacity + 1, so the relay's offload
(its excess + remainder) never exceeds its own home load: the plan always exists.

On the device: `balanced_plan` / `plain_plan` build the same plan with tensor ops of fixed shapes (no host
read), as `PlanTensors`: an R × R table `take[h, j]` (slots of h's home range that rank j processes) cut
into R² segments, zero-length ones included. Donor i in donor order serves receiver j exactly when i is the
first donor whose cumulative excess reaches j's cumulative deficit, and relays to donor i + 1 what is left
of its cumulative excess above the last cumulative deficit it covers; that is the loop of
`plan_balanced_reference` (kept as the readable construction, and the test's reference) in closed form.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ExpertPlan:
    """Which rank processes each slot of the global slot axis, and the replicas that requires.

    load: [E] int64 slots per expert (summed over source ranks); seg_start: [S] sorted starts of the
    non-empty segments on the slot axis, seg_rank: [S] their processing rank; donor[r]: the one rank whose
    experts r replicates (None: no replicas); replicas[r]: sorted global ids of r's redundant experts.
    """
    num_ranks: int
    load: torch.Tensor
    seg_start: torch.Tensor
    seg_rank: torch.Tensor
    donor: list = field(default_factory=list)
    replicas: list = field(default_factory=list)

    @property
    def experts_per_rank(self) -> int:
        return self.load.numel() // self.num_ranks

    def slot_ranks(self, positions: torch.Tensor) -> torch.Tensor:
        """Processing rank of each slot position on the global axis. positions: [n] int64 → [n] int64."""
        seg = torch.searchsorted(self.seg_start, positions, right=True) - 1
        return self.seg_rank[seg]

    def processed(self) -> list[int]:
        """Slots each rank processes."""
        ends = torch.cat([self.seg_start[1:], self.load.sum().reshape(1)])
        sizes = ends - self.seg_start
        out = torch.zeros(self.num_ranks, dtype=torch.int64).index_add_(0, self.seg_rank, sizes)
        return out.tolist()

    @property
    def has_replicas(self) -> bool:
        return any(self.replicas)


def _check(load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(load, torch.Tensor) or load.dim() != 1 or load.is_floating_point():
        raise ValueError(f"load must be a 1-D integer tensor [experts], got {getattr(load, 'shape', type(load))}")
    if load.numel() % num_ranks:
        raise ValueError(f"num_ranks {num_ranks} must divide the number of experts {load.numel()}")
    if bool((load < 0).any()):
        raise ValueError("load must be non-negative")
    return load.detach().to("cpu", torch.int64)


def plan_plain(load: torch.Tensor, num_ranks: int) -> ExpertPlan:
    """No replicas: every slot goes to its expert's home rank (ranks get whatever the routing gives them)."""
    return plain_plan(_check(load, num_ranks), num_ranks).to_plan()


def plan_balanced(load: torch.Tensor, num_ranks: int) -> ExpertPlan:
    """MoonEP plan: every rank processes exactly ⌊N/R⌋ or ⌈N/R⌉ of the N slots (exactly S×K when every
    rank routed S tokens), each rank replicates experts of at most one other rank. load: [E] int64."""
    return balanced_plan(_check(load, num_ranks), num_ranks).to_plan()


def plan_balanced_reference(load: torch.Tensor, num_ranks: int) -> ExpertPlan:
    """`plan_balanced` step by step in Python on the host (the construction of the module docstring)."""
    load = _check(load, num_ranks)
    R, E = num_ranks, load.numel()
    per = E // R
    home = load.view(R, per).sum(1).tolist()
    total = sum(home)
    capacity = [total // R + (r < total % R) for r in range(R)]
    excess = [h - c for h, c in zip(home, capacity)]
    donors = sorted((r for r in range(R) if excess[r] > 0), key=lambda r: (-excess[r], r))
    receivers = [[r, -excess[r]] for r in range(R) if excess[r] < 0]

    transfers = {r: [] for r in range(R)}  # home rank → [(taker, slots)] in axis order after the kept part
    donor_of = [None] * R
    carried = [0] * R
    for i, d in enumerate(donors):
        left = excess[d] + carried[d]
        while left > 0:
            j, need = receivers[0]
            if need <= left:
                transfers[d].append((j, need))
                donor_of[j] = d
                left -= need
                receivers.pop(0)
            else:  # relay the remainder through the next donor (one must exist: excess = deficit overall)
                nxt = donors[i + 1]
                transfers[d].append((nxt, left))
                donor_of[nxt] = d
                carried[nxt] = left
                left = 0

    # cut each home range: the kept part first, then the transfers in order
    seg_start, seg_rank, replicas = [], [], [[] for _ in range(R)]
    expert_start = (torch.cumsum(load, 0) - load).tolist()
    expert_end = torch.cumsum(load, 0).tolist()
    pos = 0
    for h in range(R):
        kept = home[h] - sum(n for _, n in transfers[h])
        pieces = [(h, kept)] + transfers[h]
        for rank, n in pieces:
            if n <= 0:
                continue
            seg_start.append(pos)
            seg_rank.append(rank)
            if rank != h:
                replicas[rank] += [e for e in range(h * per, (h + 1) * per)
                                   if expert_start[e] < pos + n and expert_end[e] > pos and load[e] > 0]
            pos += n
    replicas = [sorted(set(r)) for r in replicas]
    return ExpertPlan(R, load, torch.tensor(seg_start, dtype=torch.int64),
                      torch.tensor(seg_rank, dtype=torch.int64), donor_of, replicas)


def _exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def _overlap(start: torch.Tensor, length: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Length of [start, start + length) ∩ [lo, hi), elementwise (broadcasting)."""
    return (torch.minimum(start + length, hi) - torch.maximum(start, lo)).clamp(min=0)


@dataclass
class PlanTensors:
    """A plan held in device tensors of fixed shapes (R ranks, E experts): nothing here reads the host.

    take: [R, R] slots of home range h processed by rank j; seg_start, seg_rank: [R²] the take table laid on
    the slot axis (sorted starts, zero-length segments kept); donor: [R] the rank whose experts j replicates
    or −1; replica_mask: [R, E] the experts each rank replicates.
    """
    num_ranks: int
    load: torch.Tensor
    take: torch.Tensor
    seg_start: torch.Tensor
    seg_rank: torch.Tensor
    donor: torch.Tensor
    replica_mask: torch.Tensor
    home_segments: tuple = ()  # [E, R] start and end of the segment of expert e's home range that rank j processes

    def slot_ranks(self, positions: torch.Tensor) -> torch.Tensor:
        """Processing rank of each slot position on the global axis (a zero-length segment never wins: the
        non-empty one starting at the same place comes after it)."""
        seg = torch.searchsorted(self.seg_start, positions, right=True) - 1
        return self.seg_rank[seg]

    def _home_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, R] start and end on the slot axis of the segment of expert e's home range processed by rank j."""
        if self.home_segments:
            return self.home_segments
        R = self.num_ranks
        start = torch.empty_like(self.take).view(-1).scatter_(
            0, torch.arange(R, device=self.take.device).repeat_interleave(R) * R + self.seg_rank, self.seg_start)
        start = start.view(R, R)
        home_of = torch.arange(self.load.numel(), device=self.load.device) // (self.load.numel() // R)
        self.home_segments = start[home_of], (start + self.take)[home_of]
        return self.home_segments

    def sent(self, all_counts: torch.Tensor, source: int) -> torch.Tensor:
        """[R] slots that rank `source` sends to each rank. all_counts: [R, E] every rank's expert counts."""
        lo, hi = self._home_segments()  # [E, R]
        first = (_exclusive_cumsum(self.load) + _exclusive_cumsum(all_counts, 0)[source])[:, None]
        return _overlap(first, all_counts[source][:, None], lo, hi).sum(0)

    def received(self, all_counts: torch.Tensor, rank: int) -> torch.Tensor:
        """[R, E] slots of expert e that `rank` receives from each source rank (arriving by source, then
        expert: the order a source sends them in)."""
        lo, hi = self._home_segments()
        first = _exclusive_cumsum(self.load)[None] + _exclusive_cumsum(all_counts, 0)
        return _overlap(first, all_counts, lo[:, rank], hi[:, rank])

    def expert_shares(self) -> torch.Tensor:
        """[E, R] slots of expert e that rank j processes (each row sums to load[e])."""
        lo, hi = self._home_segments()
        ends = torch.cumsum(self.load, 0)
        return _overlap((ends - self.load)[:, None], self.load[:, None], lo, hi)

    def to_plan(self) -> ExpertPlan:
        """The host-side ExpertPlan (non-empty segments only; reads the device)."""
        keep = self.take.flatten()[self._segment_order()] > 0
        donor = [None if d < 0 else d for d in self.donor.tolist()]
        replicas = [torch.nonzero(row).flatten().tolist() for row in self.replica_mask.cpu()]
        return ExpertPlan(self.num_ranks, self.load.cpu(), self.seg_start[keep].cpu(), self.seg_rank[keep].cpu(),
                          donor, replicas)

    def _segment_order(self) -> torch.Tensor:
        """Flat indices h·R + j of the take table in segment order."""
        R = self.num_ranks
        return torch.arange(R, device=self.take.device).repeat_interleave(R) * R + self.seg_rank


def _lay_out(load: torch.Tensor, take: torch.Tensor, excess: torch.Tensor) -> PlanTensors:
    """Cut each home range as the reference does: the kept part, then receivers in rank order, then the relay
    (a rank with excess), and find every rank's donor and replicas."""
    R, E = take.shape[0], load.numel()
    dev = load.device
    ranks = torch.arange(R, device=dev)
    key = torch.where(excess[None, :] < 0, 1 + ranks[None, :], R + 1).expand(R, R).clone()
    key[ranks, ranks] = 0
    order = torch.argsort(key, dim=1, stable=True)  # [R, R]: row h's takers in axis order
    home = take.sum(1)
    starts = _exclusive_cumsum(home)[:, None] + _exclusive_cumsum(take.gather(1, order), 1)
    foreign = take.clone()
    foreign[ranks, ranks] = 0
    has_donor = (foreign > 0).any(0)
    donor = torch.where(has_donor, torch.argmax((foreign > 0).to(torch.int8), dim=0), -1)
    plan = PlanTensors(R, load, take, starts.flatten(), order.flatten(), donor, torch.empty(0))
    lo, hi = plan._home_segments()  # [E, R]
    ends = torch.cumsum(load, 0)
    home_of = torch.arange(E, device=dev) // (E // R)
    plan.replica_mask = ((home_of[:, None] != ranks[None, :]) & (load[:, None] > 0) & (hi > lo)
                         & ((ends - load)[:, None] < hi) & (ends[:, None] > lo)).T.contiguous()
    return plan


def plain_plan(load: torch.Tensor, num_ranks: int) -> PlanTensors:
    """`plan_plain` on load's device. load: [E] int64, non-negative (not checked: that would read the host)."""
    R = num_ranks
    home = load.view(R, -1).sum(1)
    return _lay_out(load, torch.diag(home), torch.zeros_like(home))


def balanced_plan(load: torch.Tensor, num_ranks: int) -> PlanTensors:
    """`plan_balanced` on load's device with tensor ops (see the module docstring). load: [E] int64."""
    R = num_ranks
    dev = load.device
    ranks = torch.arange(R, device=dev)
    home = load.view(R, -1).sum(1)
    total = home.sum()
    excess = home - (total // R + (ranks < total % R))
    donors = torch.argsort(torch.where(excess > 0, -excess, 1), stable=True)  # decreasing excess, then rank
    X = torch.cumsum(excess[donors].clamp(min=0), 0)  # cumulative excess in donor order
    deficit = (-excess).clamp(min=0)
    Y = torch.cumsum(deficit, 0)  # cumulative deficit in rank order
    take = torch.zeros(R, R, dtype=load.dtype, device=dev)
    server = donors[torch.searchsorted(X, Y).clamp(max=R - 1)]
    take.index_put_((server, ranks), deficit, accumulate=True)  # non-receivers add 0
    covered = torch.searchsorted(Y, X, right=True)  # receivers whose deficit donor i's excess ends past
    relayed = X - torch.where(covered > 0, Y[(covered - 1).clamp(min=0)], 0)
    take.index_put_((donors[:-1], donors[1:]), relayed[:-1], accumulate=True)
    take[ranks, ranks] = home - take.sum(1)
    return _lay_out(load, take, excess)
