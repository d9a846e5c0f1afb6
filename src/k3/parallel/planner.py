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
    load = _check(load, num_ranks)
    home = load.view(num_ranks, -1).sum(1)
    starts = torch.cumsum(home, 0) - home
    keep = home > 0
    return ExpertPlan(num_ranks, load, starts[keep], torch.arange(num_ranks)[keep],
                      [None] * num_ranks, [[] for _ in range(num_ranks)])


def plan_balanced(load: torch.Tensor, num_ranks: int) -> ExpertPlan:
    """MoonEP plan: every rank processes exactly ⌊N/R⌋ or ⌈N/R⌉ of the N slots (exactly S×K when every
    rank routed S tokens), each rank replicates experts of at most one other rank. load: [E] int64."""
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
