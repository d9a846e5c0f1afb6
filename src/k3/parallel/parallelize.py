"""Apply data, expert and context parallelism to a built K3ForCausalLM and drive it: batch sharding,
globally normalised loss, gradient synchronisation, and the integer all-reduce for load balancing."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3.model.decoder import K3ForCausalLM, K3Output, contiguous_segments
from k3.parallel.context_parallel import apply_context_parallel
from k3.parallel.expert_parallel import apply_expert_parallel, is_expert_param
from k3.parallel.comm import all_gather
from k3.parallel.mesh import ParallelMesh


class ParallelK3:
    """One rank's view of a K3 trained with dp × cp ranks and experts sharded over ep of them.

    Call it with the *global* batch (identical on every rank): it keeps this rank's rows (dp) and sequence
    shard (cp), runs the model and returns local logits [B/dp, T_r, V] with a loss that, summed over all
    ranks, is the global token-mean cross-entropy. After backward, `sync_gradients()` sums gradients over
    the ranks holding copies (all ranks for dense parameters; the expert-copy group for expert shards).
    """

    def __init__(self, model: K3ForCausalLM, mesh: ParallelMesh, ep_mode: str = "balanced", fsdp: bool = False):
        self.model, self.mesh = model, mesh
        dims = mesh.dims
        dims.validate(num_experts=model.config.num_experts)
        self.moe_handles = apply_expert_parallel(model, mesh.ep_group, ep_mode) if dims.ep > 1 else []
        self.cp_state = apply_context_parallel(model, mesh.cp_group) if dims.cp > 1 else None
        self.fsdp = fsdp
        if fsdp:
            from k3.parallel.fsdp import apply_fsdp
            apply_fsdp(model, mesh)

    def rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This data-parallel rank's rows of a global [B, ...] tensor."""
        if t is None:
            return None
        dp, d = self.mesh.dims.dp, self.mesh.dp_rank
        B = t.shape[0]
        if B % dp:
            raise ValueError(f"batch size {B} must be divisible by --dp {dp}")
        return t[d * B // dp:(d + 1) * B // dp]

    def __call__(self, input_ids, doc_ids=None, labels=None, mask=None) -> K3Output:
        """Global input_ids, doc_ids, labels, mask: [B, T] (the same on every rank)."""
        self.mesh.dims.validate(seq_len=input_ids.shape[1])
        ids, docs, lab, msk = (self.rows(t) for t in (input_ids, doc_ids, labels, mask))
        if self.cp_state is not None:
            s, e = self.cp_state.begin(ids.shape[1], None if docs is None else contiguous_segments(docs))
            ids, docs, lab, msk = (None if t is None else t[:, s:e] for t in (ids, docs, lab, msk))
        out = self.model(ids, doc_ids=docs, mask=msk)
        loss = None
        if lab is not None:
            logits = out.logits if out.logits.dtype == torch.float64 else out.logits.float()
            ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
            count = (lab != -100).sum().to(ce.dtype)
            dist.all_reduce(count)  # tokens of the global batch, so that the ranks' losses sum to its mean
            loss = ce / count.clamp(min=1)
        return K3Output(logits=out.logits, loss=loss)

    def sync_gradients(self) -> None:
        """Sum gradients: dense parameters over all ranks, expert shards over their copies (edp group)."""
        if not self.fsdp:  # (FSDP2 reduce-scatters the dense gradients itself during backward)
            dense = [p.grad for n, p in self.model.named_parameters() if p.grad is not None and not is_expert_param(n)]
            _all_reduce_flat(dense, None)
        self.sync_expert_gradients()

    def sync_expert_gradients(self) -> None:
        if dist.get_world_size(self.mesh.edp_group) > 1:
            experts = [p.grad for n, p in self.model.named_parameters() if p.grad is not None and is_expert_param(n)]
            _all_reduce_flat(experts, self.mesh.edp_group)

    def replica_groups(self) -> dict:
        """{parameter: process group over which it is replicated} for the plain-tensor parameters held whole by
        several ranks: dense ones by every rank (None, the default group) unless FSDP shards them, expert shards
        by their copies (the edp group). Distributed Muon spreads their orthogonalisation over those ranks."""
        out = {}
        for n, p in self.model.named_parameters():
            if _is_dtensor(p):
                continue
            group = self.mesh.edp_group if is_expert_param(n) else None
            if dist.get_world_size(group) > 1:
                out[p] = group
        return out

    def spread_muon(self, optimizer) -> None:
        """Let a Muon optimizer orthogonalise each replicated matrix once over its copies (AdamW: nothing)."""
        if hasattr(optimizer, "spread_over"):
            muon = {id(p) for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]}
            optimizer.spread_over({p: g for p, g in self.replica_groups().items() if id(p) in muon})

    @staticmethod
    def all_reduce_counts(t: torch.Tensor) -> None:
        """ExpertBalancer's hook: sum integer counts over every rank (all ranks hold different tokens)."""
        dist.all_reduce(t)

    def global_sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=next(self.model.parameters()).device)
        dist.all_reduce(t)
        return float(t)


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """One all-reduce per dtype over a flat copy (few large messages instead of one per tensor)."""
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        for g, part in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(part.view_as(g))


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "full_tensor")


def clip_grad_norm_(runner: ParallelK3, max_norm: float) -> float:
    """Global gradient norm over every rank's parameters (replicated counted once, FSDP shards summed over
    all ranks, expert shards over their EP group), then the same clip on every rank. Returns the norm."""
    dev = next(runner.model.parameters()).device  # NCCL reduces device tensors only
    # three device accumulators, read once at the end (a float() per parameter would sync the GPU each time)
    rep, world, experts = (torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(3))
    grads = []
    for n, p in runner.model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if _is_dtensor(p.grad) else p.grad
        grads.append(g)
        sq = g.detach().double().pow(2).sum()
        if is_expert_param(n):
            experts += sq
        elif _is_dtensor(p.grad):
            world += sq
        else:
            rep += sq
    dist.all_reduce(world)
    dist.all_reduce(experts, group=runner.mesh.ep_group)
    total = float(rep + world + experts) ** 0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def full_state_dict(runner: ParallelK3) -> dict:
    """The whole model's parameters and buffers on every rank (a collective): expert shards all-gathered
    over the EP group, FSDP shards gathered. Names are the checkpoint's."""
    out = {}
    for n, t in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
        t = t.detach()
        if _is_dtensor(t):
            t = t.full_tensor()
        elif is_expert_param(n) and runner.mesh.dims.ep > 1:
            t = all_gather(t.contiguous(), runner.mesh.ep_group)
        out[n] = t.clone()
    return out
