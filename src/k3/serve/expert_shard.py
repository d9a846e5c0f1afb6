"""Expert parallelism for serving: a rank keeps only its home experts (`owned_experts`, read by rank-sharded
loading, MXFP4 kept packed) and computes their share of every token's routed sum; one all-reduce over the EP
group adds the shares. Every rank holds the whole batch (replicated or tensor-parallel attention), so no token
moves between ranks: the combine is a sum of [N, latent] partials, with no host read while a CUDA graph
captures (the training `ExpertParallelCombine` reads its all-to-all splits on the host every layer and cannot
be captured). With replicas (`k3 serve --ep-replicas`), a rank also holds other ranks' hot experts, placed from
the load every rank counts on the device and moved between steps by `rebalance` (k3.serve.expert_balance)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from k3.checkpoint.convert import config_experts_format
from k3.checkpoint.sharded import RankLayout, load_rank_shard
from k3.config import K3Config
from k3.model.moe import LatentMoE
from k3.ops.grouped_mm import expert_situ_mlp_grouped, grouped_mm_supported, host_offsets_forbidden
from k3.ops.moe_decode import selected_experts_situ_mlp, use_selected_experts
from k3.ops.mx_experts import (in_decode_layout, packed_expert_situ_mlp, packed_selected_experts_situ_mlp,
                               packed_selected_experts_take)
from k3.ops.token_permute import dispatch_rows, inverse_permutation, permute_rows
from k3.ops.mxfp4_layout import scale_bias, to_decode_layout, to_released_layout
from k3.serve.expert_balance import ReplicaPlacement, place_replicas, slot_holders

MODES = ("auto", "masked", "sparse")


class ExpertShardCombine:
    """Drop-in for `LatentMoE.combine_experts(z, idx, w)` on a rank that holds experts `first .. first+count-1`.

    z: [N, L]; idx: [N, k] global expert ids; w: [N, k]. Returns the full routed sum r: [N, L] after the
    all-reduce over `group` (None: this rank's partial sum only). Two ways to compute the partial sum:
    `sparse` runs only the slots routed here (reads their count on the host: prefill, CPU); `masked` keeps all
    N·k slots in fixed shapes, no host read (what a CUDA-graph capture takes), and computes only those held
    here (`held_slots`). `auto`: masked while capturing, sparse otherwise.

    replicas > 0 (balanced replicas, k3.serve.expert_balance): the expert stacks get that many more rows for
    other ranks' experts, and the slots of a held expert are split between its holders by the placement
    (`install`, from `rebalance`); rank `rank` of `size` in the EP group. Then, and with track=True, the
    device counts `seen` ([E] slots routed to each expert) and `rows` (slots computed here) accumulate."""

    def __init__(self, moe: LatentMoE, first: int, group=None, mode: str = "auto", replicas: int = 0,
                 rank: int = 0, size: int = 1, track: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.first, self.group, self.mode = first, group, mode
        e = moe.experts
        self.count = (e.w1_packed if e.packed else e.w1).shape[0]
        self.replicas, self.rank, self.size = replicas, rank, size
        if replicas:
            _add_rows(e, replicas)
        # what LatentMoE.combine_experts reads, over the local experts only (one home for the expert dispatch)
        self.local = SimpleNamespace(experts=e, num_experts=self.count + replicas, qat=moe.qat, betas=moe.betas)
        dev = (e.w1_packed if e.packed else e.w1).device
        E = moe.num_experts
        self.seen = torch.zeros(E, dtype=torch.long, device=dev) if (replicas or track) else None
        self.rows = torch.zeros((), dtype=torch.long, device=dev) if (replicas or track) else None
        self.counted = None if self.seen is None else self.seen.clone()  # `seen` at the last placement
        self.placement: ReplicaPlacement | None = None
        self.slot_of: dict[int, int] = {}  # replica expert → its row in the local stacks
        self.fetched = 0  # replica experts whose weights were brought here so far
        self.cut = self.row_of = None
        if replicas:
            self.cut = torch.empty(E, size, dtype=torch.long, device=dev)
            self.row_of = torch.empty(E, dtype=torch.long, device=dev)
            self.install(ReplicaPlacement.home_only(E, size), None)

    def __call__(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, meanwhile=None):
        """meanwhile (LatentMoE's shared experts) runs while the all-reduce is in flight; then (r, its result)."""
        r = self.partial(z, idx, w)
        work = None if self.group is None else dist.all_reduce(r, group=self.group, async_op=True)
        extra = meanwhile() if meanwhile is not None else None
        if work is not None:
            work.wait()
        return r if meanwhile is None else (r, extra)

    def partial(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.cut is None:
            local = idx - self.first
            mine = (local >= 0) & (local < self.count)
        else:  # the holder of each slot, decided alike on every rank from the routing every rank has
            mine = slot_holders(idx, self.cut) == self.rank
            local = self.row_of[idx]
        if self.seen is not None:  # on the device: captured decode steps count too
            self.seen.scatter_add_(0, idx.flatten(), torch.ones_like(idx.flatten()))
            self.rows += mine.sum()
        capturing = z.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.mode == "masked" or (self.mode == "auto" and capturing):
            return self.held_slots(z, torch.where(mine, local, -1), w)
        N, k = idx.shape
        slots = mine.flatten().nonzero().squeeze(1)  # the host learns how many slots are here
        r = z.new_zeros(N, z.shape[1])
        if slots.numel() == 0:
            return r
        tokens = slots // k
        y = LatentMoE.combine_experts(self.local, z[tokens], local.flatten()[slots, None], w.flatten()[slots, None])
        return r.index_add_(0, tokens, y)

    def held_slots(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`LatentMoE.combine_experts` over the local stacks for the slots held here, idx < 0 marking the other
        ranks' slots: fixed shapes and no host read on CUDA (what a graph captures), and the others' slots cost
        no GEMM work. On the selected-experts path the kernels skip their programs; grouped, they sort past every
        local expert's rows, where no tile of the packed kernels' device-side schedule, and no group of
        `torch._grouped_mm`'s offsets, reaches (those rows come back unwritten and are masked). Where neither
        runs (QAT emulation; float grouped GEMMs that fall back to reading the offsets on the host) the others'
        slots go through local expert 0 with weight 0 (finite values times an exact zero)."""
        local, (N, k) = self.local, idx.shape
        e, E = local.experts, local.num_experts
        held = idx >= 0
        if use_selected_experts(N, k, E, needs_grad=False):
            if e.packed and packed_selected_experts_take(z, local.qat):
                return packed_selected_experts_situ_mlp(z, idx, w, e, *local.betas)
            if not e.packed and not local.qat:
                return selected_experts_situ_mlp(z, idx, w, e.w1, e.w3, e.w2, *local.betas)
        float_grouped = not e.packed and not local.qat and e.w1.dtype == z.dtype and \
            grouped_mm_supported(z, e.w1, e.w3, e.w2) and not host_offsets_forbidden(z, e.w1, e.w3, e.w2)
        if not (e.packed or float_grouped):
            return LatentMoE.combine_experts(local, z, torch.where(held, idx, 0), torch.where(held, w, 0))
        flat = torch.where(held, idx, E).flatten()  # the others' slots: a sink past the last local expert
        order = torch.argsort(flat, stable=True)
        slot = inverse_permutation(order)
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))[:E]
        x = dispatch_rows(z, order, slot, k)
        if e.packed:
            y = packed_expert_situ_mlp(x, counts, e, *local.betas, quantize_activations=local.qat)
        else:
            y = expert_situ_mlp_grouped(x, counts, e.w1, e.w3, e.w2, *local.betas)
        y = torch.where(held[..., None], permute_rows(y, slot, order).view(N, k, -1), 0)  # sink rows: unwritten
        return torch.bmm(w.unsqueeze(1), y).squeeze(1)

    def replica_rows(self, experts: list[int]) -> torch.Tensor:
        """[n, 1 + bytes] uint8: a layout tag (`LAYOUT_TAG`: how packed bytes are laid out) and the stacked
        weights (w1, w3, w2 or their packed bytes and scales) of home experts."""
        rows = torch.tensor(experts, dtype=torch.long, device=self.cut.device) - self.first
        tag = torch.full((len(experts), 1), _layout_tag(self.local.experts), dtype=torch.uint8, device=rows.device)
        return torch.cat([tag] + [t[rows].reshape(len(experts), -1).view(torch.uint8)
                                  for t in _stacks(self.local.experts)], dim=1)

    def fresh(self, placement: ReplicaPlacement, rank: int | None = None) -> list[int]:
        """The replicas `placement` gives `rank` (default this one) that it does not hold yet: all the weights a
        re-placement moves (the current placement is the same on every rank, so any rank can tell)."""
        rank = self.rank if rank is None else rank
        held = set(self.placement.replicas[rank]) if self.placement is not None else set()
        return [e for e in placement.replicas[rank] if e not in held]

    @torch.no_grad()
    def install(self, placement: ReplicaPlacement, fetched: torch.Tensor | None) -> None:
        """Take `placement`. `fetched`: the weights of `self.fresh(placement)` ([n, bytes] as `replica_rows`
        gives, in that order); replicas kept from the last placement stay in their rows. Every tensor is updated
        in place: captured graphs stay valid."""
        mine = placement.replicas[self.rank]
        if len(mine) > self.replicas:
            raise ValueError(f"the placement gives rank {self.rank} {len(mine)} replicas; it has room for "
                             f"{self.replicas}")
        fresh = self.fresh(placement)
        kept = {e: r for e, r in self.slot_of.items() if e in mine}
        free = [r for r in range(self.count, self.count + self.replicas) if r not in kept.values()]
        new = dict(zip(fresh, free))
        if fresh:
            if fetched is None or tuple(fetched.shape) != (len(fresh), row_width(self.local.experts)):
                got = None if fetched is None else tuple(fetched.shape)
                raise ValueError(f"fetched replica rows must be [{len(fresh)}, {row_width(self.local.experts)}] "
                                 f"(layout tag + weights), got {got}")
            parts = _arriving_stacks(self.local.experts, fetched)
            rows = torch.tensor(list(new.values()), dtype=torch.long, device=self.row_of.device)
            for t, part in zip(_stacks(self.local.experts), parts):
                t.index_copy_(0, rows, part)
        self.slot_of = {**kept, **new}
        self.fetched += len(fresh)
        row_of = torch.full_like(self.row_of, -1)
        row_of[self.first:self.first + self.count] = torch.arange(self.count, device=row_of.device)
        for e, r in self.slot_of.items():
            row_of[e] = r
        self.row_of.copy_(row_of)
        self.cut.copy_(placement.cut)
        self.placement = placement


def _stack_names(experts) -> tuple[str, ...]:
    """The expert weight stacks, in the one order replica rows are laid out in (packed: bytes, then scales)."""
    return ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale") if experts.packed \
        else ("w1", "w3", "w2")


def _stacks(experts) -> list[torch.Tensor]:
    return [getattr(experts, n) for n in _stack_names(experts)]


# The first byte of a replica row: how its packed bytes are laid out (float experts: released). Ranks may hold
# different layouts (one on a GPU in the decode layout, one not): a row is converted to the receiver's on arrival.
LAYOUT_TAG = {"released": 0, "decode": 1}


def _layout_tag(experts) -> int:
    return LAYOUT_TAG["decode" if experts.packed and in_decode_layout(experts) else "released"]


def row_width(experts) -> int:
    """Bytes of one replica row: the layout tag and one expert's rows of every stack."""
    return 1 + sum(t[0].numel() * t.element_size() for t in _stacks(experts))


def _arriving_stacks(experts, fetched: torch.Tensor) -> list[torch.Tensor]:
    """Replica rows [n, row_width] → each stack's [n, ...] part in the receiver's layout. A row in the other
    layout is converted (the bit permutation is exact); an unknown tag is refused, never decoded; a scale
    past what the receiver's decode bias covers (a constant of its captured graphs) is refused."""
    n = fetched.shape[0]
    tags = set(fetched[:, 0].tolist())
    known = {LAYOUT_TAG["released"]} if not experts.packed else set(LAYOUT_TAG.values())
    if not tags <= known:
        raise ValueError(f"replica rows carry layout tag(s) {sorted(tags - known)}; this rank takes "
                         f"{sorted(known)} ({', '.join(k for k, v in LAYOUT_TAG.items() if v in known)})")
    mine = _layout_tag(experts)
    convert = fetched[:, 0] != mine
    parts, offset = [], 1
    for name, t in zip(_stack_names(experts), _stacks(experts)):
        width = t[0].numel() * t.element_size()
        # a copy: past the tag byte a slice is misaligned for wider dtypes even where it is contiguous
        part = fetched[:, offset:offset + width].clone(memory_format=torch.contiguous_format)
        part = part.view(t.dtype).view(n, *t.shape[1:])
        offset += width
        if name.endswith("_packed") and bool(convert.any()):
            to_mine = to_decode_layout if mine == LAYOUT_TAG["decode"] else to_released_layout
            part = torch.where(convert.view(n, *[1] * (part.dim() - 1)), to_mine(part), part)
        if name.endswith("_scale") and in_decode_layout(experts) and part.numel():
            matrix = name[:-len("_scale")]
            if scale_bias(part) > experts.decode_bias[matrix]:
                raise ValueError(f"a replica's {matrix} scales need decode bias {scale_bias(part)}, past this "
                                 f"rank's {experts.decode_bias[matrix]} (use_decode_layout_ over the EP group sets "
                                 f"the largest of every rank's)")
        parts.append(part)
    return parts


@torch.no_grad()
def _add_rows(experts, n: int) -> None:
    """Give each expert stack n more (zero) rows after the home experts, for replicas; packed stays packed."""
    for name in _stack_names(experts):
        t = getattr(experts, name)
        grown = torch.cat([t.detach(), t.new_zeros(n, *t.shape[1:])])
        if name in experts._parameters:
            experts._parameters[name] = torch.nn.Parameter(grown, requires_grad=False)
        else:
            experts._buffers[name] = grown


@torch.no_grad()
def rebalance(combines: list[ExpertShardCombine], group=None) -> bool:
    """Collective over the EP group: re-place every layer's replicas from the slots routed since the last
    placement and move the replica weights (one all-to-all per layer, between steps). The load is the group's
    first rank's (broadcast), so every rank computes the same placement even if counts could differ. Returns
    False (and keeps the placement) when no slot was routed since."""
    if not combines:
        return False
    c0 = combines[0]
    R = c0.size
    since = torch.stack([c.seen - c.counted for c in combines])
    if group is not None:
        dist.broadcast(since, src=dist.get_global_rank(group, 0), group=group)
    since = since.cpu()
    if not bool(since.any()):
        return False
    for c, load in zip(combines, since):
        placement = place_replicas(load, R, c.replicas)
        per = c.count
        # what each rank lacks of my experts, and what I lack (by source rank, then id: the all-to-all's order)
        send = [[e for e in c.fresh(placement, j) if e // per == c.rank] for j in range(R)]
        need = c.fresh(placement)
        fetched = None
        if any(c.fresh(placement, j) for j in range(R)):  # the same answer on every rank: all move or all skip
            if group is None:
                raise ValueError("replicas of other ranks' experts need the EP group to fetch them")
            width = row_width(c.local.experts)
            fetched = torch.empty(len(need), width, dtype=torch.uint8, device=c.cut.device)
            rows = [e for es in send for e in es]
            dist.all_to_all_single(fetched, c.replica_rows(rows) if rows else fetched.new_empty(0, width),
                                   [sum(1 for e in need if e // per == h) for h in range(R)],
                                   [len(es) for es in send], group=group)
        c.install(placement, fetched)
        c.counted = c.seen.clone()
    return True


class ReplicaBalancer:
    """Re-places the replicas of `model`'s expert-shard combines every `every` engine steps (collective: every
    rank of the EP group calls `after_step` after each step, in lockstep)."""

    def __init__(self, model, group, every: int):
        self.combines = [m.combine_experts for m in model.modules() if isinstance(m, LatentMoE)
                         and isinstance(m.combine_experts, ExpertShardCombine) and m.combine_experts.replicas]
        self.group, self.every, self.steps, self.placements = group, every, 0, 0

    def after_step(self) -> None:
        self.steps += 1
        if self.combines and self.steps % self.every == 0:
            self.placements += rebalance(self.combines, self.group)


def load_rank_model(path, layout: RankLayout, device="cpu", dtype=None, ep_group=None, tp_group=None,
                    packed_experts: bool | None = None, mode: str = "auto", replicas: int = 0, track: bool = False):
    """The K3ForCausalLM of one serving rank: its TP block of every non-expert tensor (`tp_group`; None: whole)
    and of the routed experts only the EP rank's own (read by `load_rank_shard`, nothing else materialised), each
    LatentMoE combining over `ep_group`. packed_experts: keep MXFP4 experts packed (default: when the checkpoint
    stores them so). replicas, track: as ExpertShardCombine's. A vision-language checkpoint gives the
    K3ForConditionalGeneration around that text part, its vision tower and projector whole on every rank."""
    from k3.parallel.tensor_parallel import model_from_rank_shard

    config = K3Config.from_pretrained(Path(path))
    if packed_experts is None:
        packed_experts = config_experts_format(config) == "mxfp4"
    shard = load_rank_shard(path, layout, device=device, dtype=dtype, packed_experts=packed_experts)
    model = model_from_rank_shard(config, shard, tp_group)
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        moe.combine_experts = ExpertShardCombine(moe, shard.experts.start, ep_group, mode, replicas,
                                                 layout.ep_rank, layout.ep, track)
    from k3.vision.checkpoint import has_vision, load_pretrained as load_vision
    if has_vision(path):  # every rank encodes the images it is sent (why: k3.serve.distributed)
        return load_vision(path, device, dtype, language_model=model.eval())
    return model.eval()
