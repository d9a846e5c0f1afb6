"""The checkpoint plan: every tensor a config's checkpoint holds (released name, shape, dtype, bytes), computed
from a meta-device build, so it never allocates. The writer writes exactly this plan; `k3 info --verify`
checks a directory against it."""
from __future__ import annotations

import re
from typing import Iterator, NamedTuple

import torch

from k3.checkpoint.names import PREFIX, a_log_len, is_f32
from k3.config import K3Config
from k3.ops.mx import BLOCK

EXPERT_FORMATS = ("mxfp4", "bf16")
_STACK_RE = re.compile(r"^(.*\.experts)\.(w[123])$")
# safetensors header dtype strings
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.uint8: "U8"}
ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "U8": 1}


class TensorSpec(NamedTuple):
    """One checkpoint tensor. `source` is the k3 state name it comes from, `expert` the index into an expert
    stack (else None), `kind` one of weight / weight_packed / weight_scale for experts (else None)."""
    name: str
    shape: tuple
    dtype: str
    source: str
    expert: int | None = None
    kind: str | None = None

    @property
    def nbytes(self) -> int:
        n = ST_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def check_experts_format(experts: str) -> str:
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    return experts


def iter_plan(config: K3Config, experts: str = "mxfp4", dtype: torch.dtype = torch.bfloat16) -> Iterator[TensorSpec]:
    """Yields the checkpoint's tensors in writing order. experts: "mxfp4" (weight_packed U8 [out, in/2] +
    weight_scale U8 [out, in/32] per expert matrix) or "bf16" (unquantized `.weight` [out, in] in `dtype`).
    dtype: the dtype of every tensor that the release does not keep in F32 (BF16 as released)."""
    from k3.model.decoder import K3ForCausalLM

    check_experts_format(experts)
    if dtype not in ST_DTYPES or dtype == torch.uint8:
        raise ValueError(f"dtype must be a float dtype ({', '.join(str(d) for d in ST_DTYPES if d != torch.uint8)}), got {dtype}")
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    float_str = ST_DTYPES[dtype]
    for name, t in model.state_dict().items():
        m = _STACK_RE.match(name)
        if m:
            E, out, inp = t.shape
            base = f"{PREFIX}{m.group(1)}"
            if experts == "mxfp4" and inp % BLOCK:
                raise ValueError(f"{name}: input dimension {inp} is not a multiple of {BLOCK}; "
                                 f"MXFP4 experts need one (use experts='bf16')")
            for e in range(E):
                stem = f"{base}.{e}.{m.group(2)}"
                if experts == "mxfp4":
                    yield TensorSpec(stem + ".weight_packed", (out, inp // 2), "U8", name, e, "weight_packed")
                    yield TensorSpec(stem + ".weight_scale", (out, inp // BLOCK), "U8", name, e, "weight_scale")
                else:
                    yield TensorSpec(stem + ".weight", (out, inp), float_str, name, e, "weight")
        elif name.endswith("A_log"):
            yield TensorSpec(PREFIX + name, (a_log_len(t.shape[0]),), "F32", name)
        else:
            yield TensorSpec(PREFIX + name, tuple(t.shape), "F32" if is_f32(name) else float_str, name)


def plan_tensors(config: K3Config, experts: str = "mxfp4", dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """The whole plan as a list (see `iter_plan`)."""
    return list(iter_plan(config, experts, dtype))


def plan_totals(config: K3Config, experts: str = "mxfp4", dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(tensor count, bytes of tensor data) of the plan, streamed (no list of half a million entries)."""
    count = total = 0
    for spec in iter_plan(config, experts, dtype):
        count += 1
        total += spec.nbytes
    return count, total


def expert_stacks(config: K3Config) -> dict[str, tuple[int, int, int]]:
    """k3 name of every expert stack → (num_experts, out, in), from the config alone."""
    E, I, L = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
    stacks = {}
    for l in range(config.num_hidden_layers):
        if config.is_moe(l):
            p = f"model.layers.{l}.block_sparse_moe.experts."
            stacks |= {p + "w1": (E, I, L), p + "w2": (E, L, I), p + "w3": (E, I, L)}
    return stacks


def group_into_shards(plan: list, max_shard_bytes: int) -> list[list]:
    """Consecutive tensor specs packed greedily into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards, size = [[]], 0
    for spec in plan:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards
