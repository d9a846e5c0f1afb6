"""Rank-sharded loading of a released checkpoint: each rank of an expert-parallel (× tensor-parallel) layout
opens only the shards that hold its tensors (found through the index) and reads only its bytes (safetensors
`get_slice`, memory-mapped): its EP rank's home experts (`owned_experts`, the training rule) and, under
tensor parallelism, its block of attention heads, of MLP width and of the vocabulary (`tp_slice`). Nothing it does not own is ever read into memory; tensors
go to the rank's device as they are read; MXFP4 experts can stay packed."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.checkpoint.hf import (CheckpointError, _check_expert_header, _LiveBytes, is_vision, open_shard, read_index,
                              resolve_dtype, shard_files)
from k3.checkpoint.names import PREFIX, a_log_len, is_f32, parse_name
from k3.checkpoint.plan import expert_stacks
from k3.config import K3Config
from k3.ops.mx import BLOCK, mxfp4_pack, mxfp4_unpack
from k3.parallel.expert_parallel import owned_experts

# Tensors split under tensor parallelism: name pattern → the dim split into tp contiguous blocks. Attention
# tensors are head-major, so a block is a rank's heads; MLPs split their intermediate width (Megatron's column
# then row split); the embedding and lm_head split the vocabulary. The low-rank MLA/KDA inputs, the norms, the
# router and the latent projections stay whole on every rank.
_HEAD_DIMS = (
    (re.compile(r"self_attn\.(q|k|v|g)_proj\.weight$"), 0),          # KDA q/k/v/gate, MLA gate: [H*d, D]
    (re.compile(r"self_attn\.(q|k|v)_conv1d\.weight$"), 0),          # [H*d, 1, W]
    (re.compile(r"self_attn\.(f_b_proj|b_proj)\.weight$"), 0),       # [H*d, d], [H, D]
    (re.compile(r"self_attn\.(A_log|dt_bias)$"), 0),                 # [H], [H*d]
    (re.compile(r"self_attn\.(q_b_proj|kv_b_proj)\.weight$"), 0),    # MLA [H*(nope+rope), q_rank], [H*(nope+v), kv_rank]
    (re.compile(r"self_attn\.o_proj\.weight$"), 1),                  # [D, H*d]
)
_WIDTH_DIMS = (
    (re.compile(r"(mlp|shared_experts)\.(gate|up)_proj\.weight$"), 0),  # [I, D]
    (re.compile(r"(mlp|shared_experts)\.down_proj\.weight$"), 1),      # [D, I]
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), 0),        # [V, D]
)


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: EP rank `ep_rank` of `ep` (its home experts) and TP rank `tp_rank` of `tp` (its
    block of attention heads, MLP width and vocabulary; tp=1: everything whole)."""
    ep_rank: int = 0
    ep: int = 1
    tp_rank: int = 0
    tp: int = 1

    def __post_init__(self):
        for name, r, n in (("ep", self.ep_rank, self.ep), ("tp", self.tp_rank, self.tp)):
            if not (isinstance(n, int) and n >= 1 and isinstance(r, int) and 0 <= r < n):
                raise ValueError(f"RankLayout: {name}_rank {r!r} must lie in 0..{name}-1 with {name}={n!r} >= 1")

    @classmethod
    def all(cls, ep: int, tp: int = 1) -> list["RankLayout"]:
        """Every rank of an ep × tp layout, EP-major."""
        return [cls(e, ep, t, tp) for e in range(ep) for t in range(tp)]


def tp_split_dim(name: str) -> tuple[int, bool] | None:
    """(dim, by heads?) along which tensor parallelism splits k3 tensor `name`, or None when it stays whole."""
    for pattern, dim in _HEAD_DIMS:
        if pattern.search(name):
            return dim, True
    for pattern, dim in _WIDTH_DIMS:
        if pattern.search(name):
            return dim, False
    return None


def tp_slice(name: str, shape: tuple, config: K3Config, layout: RankLayout) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the rank's block of k3 tensor `name` (full shape `shape`), or None when it is whole."""
    split = tp_split_dim(name) if layout.tp > 1 else None
    if split is None:
        return None
    dim, by_heads = split
    if by_heads:
        heads = config.num_attention_heads if _is_mla_name(name, config) else config.linear_attn_config.num_heads
        if heads % layout.tp:
            raise ValueError(f"tensor parallel size {layout.tp} must divide the {heads} attention heads")
    elif shape[dim] % layout.tp:
        raise ValueError(f"tensor parallel size {layout.tp} must divide dim {dim} of {name} {list(shape)}")
    per = shape[dim] // layout.tp
    return dim, layout.tp_rank * per, (layout.tp_rank + 1) * per


def _is_mla_name(name: str, config: K3Config) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and config.is_mla(int(m.group(1)))


@dataclass
class RankShard:
    """What one rank loaded. tensors: k3 names → tensors on the rank's device; an expert stack holds the rank's
    experts only (`...experts.w1` [len(experts), out, in], or `w1_packed`/`w1_scale` when packed); a TP-sliced
    tensor holds `slices[name] = (dim, start, stop)` of the full one. opened: the shard files it opened."""
    layout: RankLayout
    experts: range
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    slices: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    opened: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def _needed_files(path: Path, experts: range) -> list[Path]:
    """The shards holding anything but other ranks' experts, from the index (no index: every shard)."""
    idx = read_index(path)
    if idx is None:
        return shard_files(path)
    files = set()
    for raw, fname in idx["weight_map"].items():
        if is_vision(raw):
            continue
        _, e, _ = parse_name(raw)
        if e is None or e in experts:
            files.add(fname)
    return [path / f for f in sorted(files)]


def load_rank_shard(path, layout: RankLayout, device="cpu", dtype: torch.dtype | str | None = None,
                    packed_experts: bool = False) -> RankShard:
    """Loads rank `layout`'s part of checkpoint `path` onto `device`, equal (bit for bit) to the same part of
    `load_pretrained(path, device, dtype, packed_experts)`'s state dict. Missing, mis-shaped and mis-typed
    tensors are reported together in one CheckpointError. stats: `peak_live_bytes` (most bytes read from
    files alive at once), `largest_read_bytes` (the largest single read), `largest_tensor_bytes` (the largest
    tensor placed, an expert stack included), `read_bytes` (all bytes read)."""
    from k3.model.decoder import K3ForCausalLM

    path = Path(path)
    config = K3Config.from_pretrained(path)
    dtype = resolve_dtype(dtype, config) or torch.float32
    device = torch.device(device)
    experts = owned_experts(config.num_experts, layout.ep_rank, layout.ep)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in K3ForCausalLM(config, init=False).state_dict().items()}
    for heads in (config.linear_attn_config.num_heads, config.num_attention_heads):
        if heads % layout.tp:
            raise ValueError(f"tensor parallel size {layout.tp} must divide the {heads} attention heads")
    cuts = {n: tp_slice(n, s, config, layout) for n, s in shapes.items()}  # every size checked before any read
    stacks = expert_stacks(config)
    shard = RankShard(layout, experts)
    n_local = len(experts)
    for stack, (_, out, inp) in stacks.items():
        if packed_experts:
            shard.tensors[stack + "_packed"] = torch.empty(n_local, out, inp // 2, dtype=torch.uint8, device=device)
            shard.tensors[stack + "_scale"] = torch.empty(n_local, out, inp // BLOCK, dtype=torch.uint8, device=device)
        else:
            shard.tensors[stack] = torch.empty(n_local, out, inp, dtype=dtype, device=device)
    seen, expert_kinds, pending, problems = set(), {}, {}, []
    live, read_bytes, largest_read = _LiveBytes(), 0, 0

    def read(handle, f, raw, index=None) -> torch.Tensor:
        nonlocal read_bytes, largest_read
        try:
            sl = handle.get_slice(raw)
            t = sl[:] if index is None else sl[index]
        except Exception as e:  # safetensors raises its own error types on a truncated file
            raise CheckpointError(f"corrupt shard {f}: cannot read {raw}: {e}") from None
        read_bytes += t.numel() * t.element_size()
        largest_read = max(largest_read, t.numel() * t.element_size())
        return live.track(t)

    def put_expert(stack: str, j: int, kind: str, t: torch.Tensor) -> None:
        if packed_experts:
            if kind == "weight":
                packed, scale = mxfp4_pack(t)
                shard.tensors[stack + "_packed"][j].copy_(packed)
                shard.tensors[stack + "_scale"][j].copy_(scale)
            else:
                shard.tensors[f"{stack}_{kind.removeprefix('weight_')}"][j].copy_(t)
        elif kind == "weight":
            shard.tensors[stack][j].copy_(t)
        else:  # dequantize once both halves are here
            half = pending.setdefault((stack, j), {})
            half[kind] = t
            if len(half) == 2:
                del pending[(stack, j)]
                w = shard.tensors[stack]
                w[j].copy_(mxfp4_unpack(half["weight_packed"], half["weight_scale"], torch.float32).to(w.dtype))

    for f in _needed_files(path, experts):
        if not f.is_file():
            problems.append(f"shard file missing: {f.name}")
            continue
        shard.opened.append(f.name)
        with open_shard(f) as handle:
            for raw in handle.keys():
                if is_vision(raw):
                    continue
                name, e, kind = parse_name(raw)
                if e is not None:
                    if name in stacks and e not in experts:
                        continue  # another rank's expert in a shared shard: never read
                    problem = _check_expert_header(handle, raw, stacks.get(name), e, kind)
                    if problem:
                        problems.append(problem)
                        continue
                    kinds = expert_kinds.setdefault((name, e), set())
                    kinds.add(kind)
                    if "weight" in kinds and len(kinds) > 1:
                        problems.append(f"{raw}: expert stored both unquantized and as MXFP4")
                        continue
                    with torch.no_grad():
                        put_expert(name, e - experts.start, kind, read(handle, f, raw))
                    continue
                if name not in shapes:
                    problems.append(f"unexpected tensor {raw}")
                    continue
                seen.add(name)
                sl = handle.get_slice(raw)
                full = shapes[name]
                want = (a_log_len(full[0]),) if name.endswith("A_log") else full
                if tuple(sl.get_shape()) != want:
                    problems.append(f"{raw}: shape {tuple(sl.get_shape())}, expected {want}")
                    continue
                if sl.get_dtype() not in ("F32", "BF16", "F16", "F64"):
                    problems.append(f"{raw}: dtype {sl.get_dtype()}, expected a floating type")
                    continue
                cut = cuts[name]
                if name.endswith("A_log"):  # drop the released padding (and take the rank's heads)
                    cut = cut or (0, 0, full[0])
                index = None if cut is None else (slice(None),) * cut[0] + (slice(cut[1], cut[2]),)
                t = read(handle, f, raw, index)
                # a fresh tensor on the device, never a view of the file mapping (the file may change under it)
                placed = torch.empty(t.shape, dtype=torch.float32 if is_f32(name) else dtype, device=device)
                shard.tensors[name] = placed.copy_(t)
                if cut is not None and not (name.endswith("A_log") and layout.tp == 1):
                    shard.slices[name] = cut
                del t
    for name in sorted(set(shapes) - seen - {s + x for s in stacks for x in ("", "_packed", "_scale")}):
        problems.append(f"missing tensor {PREFIX}{name}")
    for stack in stacks:
        missing = [e for e in experts if not ({"weight"} <= expert_kinds.get((stack, e), set())
                                              or {"weight_packed", "weight_scale"} <= expert_kinds.get((stack, e), set()))]
        if missing:
            problems.append(f"missing tensor experts {missing[:5]}{'...' * (len(missing) > 5)} of {PREFIX}{stack}")
    if problems:
        shown = "\n  ".join(problems[:50])
        raise CheckpointError(f"checkpoint {path} does not match its config for rank {layout} "
                              f"({len(problems)} problems):\n  {shown}")
    shard.stats = {"peak_live_bytes": live.peak, "read_bytes": read_bytes, "largest_read_bytes": largest_read,
                   "largest_tensor_bytes": max(t.numel() * t.element_size() for t in shard.tensors.values())}
    return shard
