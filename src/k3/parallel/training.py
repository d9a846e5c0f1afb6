"""The trainer's distributed hooks: join the torchrun process group, parallelize the model, and offer the
few calls the training loop needs (forward on the global batch, gradient sync, global clip, global loss,
evaluation sums, and a full model for rank 0 to save)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3.model.decoder import K3ForCausalLM
from k3.parallel.mesh import ParallelDims, ParallelMesh, init_distributed
from k3.parallel.parallelize import ParallelK3, clip_grad_norm_, full_state_dict


class DistributedTraining:
    """Built by the Trainer when --dp/--ep/--cp ask for more than one process. Every rank sees the same
    global batches (same loader seed); `ParallelK3` keeps this rank's rows and sequence shard."""

    def __init__(self, model: K3ForCausalLM, dp: int, ep: int, cp: int, seq_len: int, ep_mode: str = "balanced"):
        dims = ParallelDims(dp=dp, ep=ep, cp=cp).validate(num_experts=model.config.num_experts, seq_len=seq_len)
        _, world = init_distributed()
        dims.validate(world_size=world)
        self.mesh = ParallelMesh(dims)
        self.runner = ParallelK3(model, self.mesh, ep_mode=ep_mode)
        self.is_main = dist.get_rank() == 0

    def __call__(self, input_ids, doc_ids=None, labels=None, mask=None):
        return self.runner(input_ids, doc_ids=doc_ids, labels=labels, mask=mask)

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
        """(summed cross-entropy, token count) of one global batch, over all ranks."""
        count = int((b["labels"] != -100).sum())
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
