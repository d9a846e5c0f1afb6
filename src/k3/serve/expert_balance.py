"""Balanced expert replicas for expert-parallel serving: MoonEP's plan (SPEC §5) in the form serving needs.

In serving every EP rank sees every token (k3.serve.expert_shard), so no token moves between ranks; what is
unequal is the expert work: each rank computes all slots of its home experts, and under skewed routing the rank
holding the hot experts is every step's straggler. Here a rank also holds up to `cap` replicas of other ranks'
experts, and each slot of a held expert goes to one of its holders by a rule that every rank evaluates the same
way from the routing it already has: no count exchange, fixed shapes, no host read (decode graphs still capture).

Static replicas, not the per-step fetch of MoonEP training: training fetches replica weights because its tokens
cross ranks anyway and a step's S×K slots pay for the bytes. A serving step moves no tokens, and fetching one
released K3 expert (3 × 3072 × 3584 MXFP4 values, about 17 MB with scales) over NVLink (~400 GB/s) takes ~40 µs:
more than the whole expert's GEMM for fewer than ~400 slots on an H200, per replica per layer per step. So the
replicas stay resident (`cap` experts per rank and MoE layer: memory, as vLLM's EPLB redundant experts), chosen
from the load every rank counts on the device, and moved only when the placement is recomputed (every few
hundred steps, k3.serve.expert_shard.rebalance), never inside a step.

Placement (`place_replicas`): MoonEP's balanced plan (k3.parallel.planner.balanced_plan) of the measured load
gives every rank ⌊N/R⌋ or ⌈N/R⌉ of its N slots; its donated segments are the tail of a donor's home block on
the slot axis, so each home block is laid coldest-first: the donations then cover the hottest experts, the
fewest replicas. A rank given more than `cap` replicas keeps its `cap` largest shares; the rest stay home.

Split (`slot_holders`): expert e's shares become cumulative cut points `cut[e, j]` in units of 1/SCALE of its
slots. In a step with c slots of e, the p-th of them (token order) goes to the first rank j with
⌊cut[e, j]·c / SCALE⌋ > p, so rank j takes its planned fraction of every expert to within one slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.parallel.planner import balanced_plan

SCALE = 1 << 20  # cut points in 1/SCALE of an expert's slots; products with a step's slot count stay in int64


@dataclass
class ReplicaPlacement:
    """Which ranks hold each expert and what fraction of its slots each takes.

    share: [E, R] int64 slots of the measured load each rank was planned (rows sum to the load; a zero-load
    expert plans nothing and goes home whole); cut: [E, R] int64 cumulative cut points (last column SCALE);
    replicas[j]: sorted ids of the other ranks' experts rank j holds."""
    share: torch.Tensor
    cut: torch.Tensor
    replicas: list[list[int]]

    @property
    def num_ranks(self) -> int:
        return self.cut.shape[1]

    @classmethod
    def home_only(cls, num_experts: int, num_ranks: int) -> "ReplicaPlacement":
        """No replicas: every slot to its expert's home rank."""
        return _placement(torch.zeros(num_experts, num_ranks, dtype=torch.int64), num_ranks)


def home_ranks(num_experts: int, num_ranks: int) -> torch.Tensor:
    """[E] home rank of each expert (contiguous blocks, as k3.parallel.expert_parallel.owned_experts)."""
    return torch.arange(num_experts) // (num_experts // num_ranks)


def place_replicas(load: torch.Tensor, num_ranks: int, cap: int) -> ReplicaPlacement:
    """The placement for a measured load. load: [E] non-negative int slots per expert; cap: replicas per rank."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap must be an integer >= 0, got {cap!r}")
    if not isinstance(load, torch.Tensor) or load.dim() != 1 or load.is_floating_point() or bool((load < 0).any()):
        raise ValueError("load must be a 1-D tensor of non-negative integer slot counts")
    if num_ranks < 1 or load.numel() % num_ranks:
        raise ValueError(f"{num_ranks} ranks must divide the {load.numel()} experts")
    load = load.to("cpu", torch.int64)
    E, R = load.numel(), num_ranks
    home = home_ranks(E, R)
    coldest_first = torch.argsort(home * (int(load.max()) + 1) + load, stable=True)  # blocks stay in rank order
    share = torch.zeros(E, R, dtype=torch.int64)
    share[coldest_first] = balanced_plan(load[coldest_first], R).expert_shares()
    for j in range(R):
        held = ((share[:, j] > 0) & (home != j)).nonzero().flatten()
        if held.numel() > cap:  # keep the largest shares; the rest of those slots stay with their home rank
            back = held[torch.argsort(share[held, j], descending=True, stable=True)[cap:]]
            share[back, home[back]] += share[back, j]
            share[back, j] = 0
    return _placement(share, R)


def _placement(share: torch.Tensor, num_ranks: int) -> ReplicaPlacement:
    E = share.shape[0]
    home = home_ranks(E, num_ranks)
    load = share.sum(1, keepdim=True)
    at_home = torch.where(torch.arange(num_ranks)[None] >= home[:, None], SCALE, 0)  # zero load: all home
    cut = torch.where(load > 0, torch.cumsum(share, 1) * SCALE // load.clamp(min=1), at_home)
    replicas = [((share[:, j] > 0) & (home != j)).nonzero().flatten().tolist() for j in range(num_ranks)]
    return ReplicaPlacement(share, cut, replicas)


def slot_holders(idx: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """The rank that computes each routed slot. idx: [N, k] global expert ids; cut: [E, R] (on idx's device).
    Returns [N, k] int64. Tensor ops of fixed shapes: no host read."""
    flat = idx.flatten()
    n, E = flat.numel(), cut.shape[0]
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts
    # p: each slot's place among its expert's slots, in token order
    p = torch.empty_like(flat).scatter_(0, order, torch.arange(n, device=flat.device) - first[flat[order]])
    bounds = cut[flat] * counts[flat, None] // SCALE  # [n, R] slots of this expert taken by ranks ≤ j
    return (bounds <= p[:, None]).sum(1).view(idx.shape)
