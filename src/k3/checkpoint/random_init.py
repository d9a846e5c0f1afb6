"""`k3 init`: a freshly initialised model written straight into the released layout, shard by shard, without
building the model: each planned tensor is drawn (the model's own init rule, `K3ForCausalLM.reset_parameters`),
packed to MXFP4 if it is a routed expert, written, and dropped. Only one shard's tensors exist at a time, so a
K3-shaped checkpoint far larger than host memory can be written."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.checkpoint.hf import INDEX_NAME, mxfp4_quantization_config
from k3.checkpoint.plan import TensorSpec, check_experts_format, group_into_shards, iter_plan
from k3.checkpoint.staging import check_new_out, staged_out
from k3.config import K3Config
from k3.ops.mx import BLOCK, mxfp4_pack

_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class _OneTensor:
    """Stands in for the model in `K3ForCausalLM.reset_parameters`, so one tensor gets the model's init rule
    (by its name) without the model existing: one home for the rule."""

    def __init__(self, config: K3Config, name: str, t: torch.Tensor):
        self.config, self._items = config, [(name, t)]

    def named_parameters(self):
        return iter(self._items)


def _drawn(config: K3Config, source: str, shape: tuple, seed: int, index: int) -> torch.Tensor:
    """A float32 tensor of `shape` with the model's init for parameter `source`, from generator (seed, index)."""
    from k3.model.decoder import K3ForCausalLM

    t = torch.empty(shape, dtype=torch.float32)
    K3ForCausalLM.reset_parameters(_OneTensor(config, source, t), seed=seed * 1_000_003 + index)
    return t


class _ShardProducer:
    """Makes the planned tensors of one shard. Every tensor has its own generator (seed, its position in the
    whole plan), so the result depends neither on the shard size nor on which worker makes which shard; an
    expert matrix is drawn and packed once for its weight_packed and weight_scale halves (again by the shard
    holding weight_scale when the pair straddles two shards). device: where expert matrices are packed."""

    def __init__(self, config: K3Config, seed: int, device: torch.device):
        self.config, self.seed, self.device = config, seed, device
        self._pair: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _pack(self, spec: TensorSpec, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scale) of the expert matrix drawn at plan position `index` (its weight_packed's)."""
        if self._pair is None or self._pair[0] != index:
            inp = spec.shape[1] * (2 if spec.kind == "weight_packed" else BLOCK)  # the matrix's input width
            w = _drawn(self.config, spec.source, (spec.shape[0], inp), self.seed, index)
            packed, scale = mxfp4_pack(w.to(self.device))
            self._pair = (index, packed.cpu(), scale.cpu())
        return self._pair[1], self._pair[2]

    def __call__(self, spec: TensorSpec, index: int) -> torch.Tensor:
        if spec.kind == "weight_packed":
            return self._pack(spec, index)[0]
        if spec.kind == "weight_scale":  # the matrix of the weight_packed just before it in the plan
            return self._pack(spec, index - 1)[1]
        if spec.source.endswith("e_score_correction_bias"):  # a buffer, zero at construction
            return torch.zeros(spec.shape, dtype=torch.float32)
        if spec.source.endswith("A_log"):  # released padded to 128 entries
            t = _drawn(self.config, spec.source, (self.config.linear_attn_config.num_heads,), self.seed, index)
            padded = torch.zeros(spec.shape, dtype=torch.float32)
            padded[: t.shape[0]] = t
            return padded
        return _drawn(self.config, spec.source, spec.shape, self.seed, index).to(_TORCH[spec.dtype])


def write_random_checkpoint(config: K3Config, out, experts: str = "mxfp4", seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                            device: str | torch.device = "cpu", workers: int = 1, progress: bool = False) -> dict:
    """Writes a randomly initialised `config` model to `out` (config.json, shards, index) with routed experts
    "mxfp4" (packed) or "bf16". device: where the expert matrices are packed (a GPU makes it fast); workers:
    shards made at once, by threads (torch's kernels run outside the GIL; each holds one shard in memory).
    `out` must be missing or empty; the files are written beside it and renamed into place when whole.
    Returns {"shards", "tensors", "bytes"}."""
    check_experts_format(experts)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    out = Path(out)
    check_new_out(out, "init")
    device = torch.device(device)
    plan = list(iter_plan(config, experts, dtype))
    groups = group_into_shards(plan, max_shard_bytes)
    firsts = [1]  # plan position (from 1) of each shard's first tensor
    for specs in groups[:-1]:
        firsts.append(firsts[-1] + len(specs))
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]

    def write_shard(tmp: Path, i: int) -> None:
        produce = _ShardProducer(config, seed, device)
        tensors = {spec.name: produce(spec, firsts[i] + j) for j, spec in enumerate(groups[i])}
        save_file(tensors, str(tmp / names[i]), metadata={"format": "pt"})

    with staged_out(out, "init") as tmp:
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm
        with ThreadPoolExecutor(workers) as pool:
            for _ in tqdm(pool.map(lambda i: write_shard(tmp, i), range(len(groups))), total=len(groups), desc="init",
                          unit="shard", leave=False, disable=None if progress else True):
                pass
        weight_map = {spec.name: names[i] for i, specs in enumerate(groups) for spec in specs}
        total = sum(spec.nbytes for spec in plan)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        config.replace(dtype=str(dtype).removeprefix("torch."),
                       quantization_config=mxfp4_quantization_config() if experts == "mxfp4" else None
                       ).save(tmp / "config.json")
    return {"shards": len(groups), "tensors": len(plan), "bytes": total}
