"""The trainer's distributed hooks: join the torchrun process group, parallelize the model, and offer the
few calls the training loop needs (forward on the global batch, gradient sync, global clip, global loss,
evaluation sums, a full model for rank 0 to save, and per-rank optimizer state for exact resume)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3.model.decoder import K3ForCausalLM
from k3.parallel.checkpoint import layout, load_full_state_dict, load_local_optimizer_state, local_optimizer_state
from k3.parallel.mesh import ParallelDims, ParallelMesh, init_distributed
from k3.parallel.parallelize import ParallelK3, clip_grad_norm_, full_state_dict


class DistributedTraining:
    """Built by the Trainer when --dp/--ep/--cp ask for more than one process. Every rank sees the same
    global batches (same loader seed); `ParallelK3` keeps this rank's rows and sequence shard."""

    def __init__(self, model: K3ForCausalLM, dp: int, ep: int, cp: int, seq_len: int, ep_mode: str = "balanced",
                 fsdp: bool = False):
        dims = ParallelDims(dp=dp, ep=ep, cp=cp).validate(num_experts=model.config.num_experts, seq_len=seq_len)
        _, world = init_distributed()
        dims.validate(world_size=world)
        self.mesh = ParallelMesh(dims)
        # fsdp: the non-expert parameters become DTensor shards over all ranks (build the optimizer after this)
        self.runner = ParallelK3(model, self.mesh, ep_mode=ep_mode, fsdp=fsdp)
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0

    def __call__(self, input_ids, doc_ids=None, labels=None, mask=None):
        return self.runner(input_ids, doc_ids=doc_ids, labels=labels, mask=mask)

    def spread_muon(self, optimizer) -> None:
        """Distributed Muon for the replicated matrices (call once, after building the optimizer)."""
        self.runner.spread_muon(optimizer)

    def sync_gradients(self) -> None:
        self.runner.sync_gradients()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return clip_grad_norm_(self.runner, max_norm)

    def global_sum(self, x: float) -> float:
        return self.runner.global_sum(x)

    def all_reduce_counts(self, t: torch.Tensor) -> None:
        self.runner.all_reduce_counts(t)

    @torch.no_grad()
    def eval_sums(self, b: dict) -> tuple[float, int]:
        """(summed cross-entropy, token count) of one global batch, over all ranks. A batch whose rows do not
        split over the dp ranks (the validation split's last one) is padded with copies of its first row
        whose labels are all ignored."""
        count = int((b["labels"] != -100).sum())
        rows, short = b["input_ids"].shape[0], -b["input_ids"].shape[0] % self.mesh.dims.dp
        if short:
            b = {k: torch.cat([v, v[:1].expand(short, *v.shape[1:])]) for k, v in b.items()}
            b["labels"][rows:] = -100
        out = self.runner(b["input_ids"], doc_ids=b.get("doc_ids"), labels=b["labels"])
        return self.global_sum(float(out.loss)) * count, count

    def full_model(self) -> K3ForCausalLM:
        """A single-process copy with every expert (a collective: all ranks call it)."""
        state = full_state_dict(self.runner)
        with torch.device("meta"):
            full = K3ForCausalLM(self.runner.model.config, init=False)
        full.load_state_dict(state, assign=True)
        return full

    def barrier(self) -> None:
        dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank (so that all ranks stop at the same step)."""
        return self.global_sum(float(bool(flag))) > 0

    # ---- checkpoints: rank 0 writes the full model, every rank its own optimizer state -----------------
    @property
    def layout(self) -> dict:
        return layout(self.runner)

    def load_full_state_dict(self, state: dict) -> None:
        """A full single-process state dict into this rank's shards (experts and FSDP)."""
        load_full_state_dict(self.runner, state)

    @staticmethod
    def optimizer_state(optimizer) -> dict:
        return local_optimizer_state(optimizer)

    @staticmethod
    def load_optimizer_state(optimizer, state: dict) -> None:
        load_local_optimizer_state(optimizer, state)
