"""`k3 convert` and `k3 info DIR [--verify]`: re-encode a checkpoint's routed experts (bf16 <-> MXFP4) shard by
shard without building the model, list what a directory holds, and check it against its config's plan."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3.checkpoint.hf import INDEX_NAME, CheckpointError, is_vision, mxfp4_quantization_config, read_index, shard_files
from k3.checkpoint.names import PREFIX
from k3.checkpoint.plan import ST_BYTES, group_into_shards, iter_plan
from k3.checkpoint.staging import check_new_out, staged_out
from k3.config import K3Config
from k3.ops.mx import mxfp4_pack, mxfp4_unpack

_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def config_experts_format(config: K3Config) -> str:
    q = config.quantization_config or {}
    return "mxfp4" if q.get("format") == "mxfp4-pack-quantized" else "bf16"


def config_float_dtype(config: K3Config) -> torch.dtype:
    dt = getattr(torch, str(config.dtype), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.bfloat16


def read_headers(path: Path) -> dict[str, tuple[tuple, str, str]]:
    """Released name (with prefix) → (shape, safetensors dtype, file name), from the shard headers only."""
    out = {}
    for f in shard_files(path):
        if not f.is_file():
            raise CheckpointError(f"shard file missing: {f}")
        try:
            with safe_open(str(f), framework="pt") as h:
                for raw in h.keys():
                    sl = h.get_slice(raw)
                    name = raw if raw.startswith(PREFIX) or is_vision(raw) else PREFIX + raw
                    out[name] = (tuple(sl.get_shape()), sl.get_dtype(), f.name, raw)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read shard {f}: {e}") from None
    return out


def inventory(path) -> dict:
    """What a checkpoint directory holds: shards, tensor count and bytes per dtype, expert format, vision."""
    path = Path(path)
    heads = read_headers(path)
    by_dtype, nbytes = Counter(), Counter()
    vision = 0
    kinds = Counter()
    for name, (shape, dt, _, _) in heads.items():
        if is_vision(name):
            vision += 1
            continue
        by_dtype[dt] += 1
        nbytes[dt] += ST_BYTES.get(dt, 0) * _numel(shape)
        for k in ("weight_packed", "weight_scale"):
            if ".experts." in name and name.endswith(k):
                kinds[k] += 1
        if ".experts." in name and name.endswith(".weight"):
            kinds["weight"] += 1
    return {"shards": len(shard_files(path)), "text_tensors": sum(by_dtype.values()), "vision_tensors": vision,
            "text_bytes": sum(nbytes.values()), "tensors_by_dtype": dict(by_dtype), "bytes_by_dtype": dict(nbytes),
            "expert_tensors": dict(kinds)}


def verify_checkpoint(path) -> dict:
    """Checks a directory against the plan of its own config.json: every planned tensor present with the planned
    shape and dtype, nothing unexpected, the index naming the file that really holds each tensor, the index
    total_size, the tensor count and the byte total. Returns a report whose `problems` list is empty when all
    hold (headers only: no tensor data is read)."""
    path = Path(path)
    config = K3Config.from_pretrained(path)
    experts = config_experts_format(config)
    heads = read_headers(path)
    problems, count, total = [], 0, 0
    planned = set()
    for spec in iter_plan(config, experts, config_float_dtype(config)):
        count += 1
        total += spec.nbytes
        planned.add(spec.name)
        got = heads.get(spec.name)
        if got is None:
            problems.append(f"missing tensor {spec.name}")
        elif got[0] != spec.shape or got[1] != spec.dtype:
            problems.append(f"{spec.name}: {got[1]} {list(got[0])}, expected {spec.dtype} {list(spec.shape)}")
    text = {n: h for n, h in heads.items() if not is_vision(n)}
    problems += [f"unexpected tensor {n}" for n in sorted(set(text) - planned)]
    found_bytes = sum(ST_BYTES.get(dt, 0) * _numel(shape) for shape, dt, _, _ in heads.values())
    idx = read_index(path)
    if idx is not None:
        where, listed = {h[3]: h[2] for h in heads.values()}, idx["weight_map"]  # read_index: a mapping
        if listed != where:
            bad = [n for n in set(where) | set(listed) if listed.get(n) != where.get(n)]
            problems.append(f"index weight_map disagrees with the shards for {len(bad)} tensors, e.g. {sorted(bad)[:3]}")
        meta = idx.get("metadata")
        listed_size = meta.get("total_size") if isinstance(meta, dict) else None  # a hostile index: not a crash
        if listed_size != found_bytes:
            problems.append(f"index total_size {listed_size} != {found_bytes} bytes in the shards")
    text_bytes = found_bytes - sum(ST_BYTES.get(h[1], 0) * _numel(h[0]) for n, h in heads.items() if is_vision(n))
    if len(text) != count:
        problems.append(f"{len(text)} text tensors, the config's plan has {count}")
    if text_bytes != total:
        problems.append(f"{text_bytes} bytes of text tensors, the config's plan has {total}")
    return {"experts": experts, "expected_tensors": count, "expected_bytes": total, "text_tensors": len(text),
            "text_bytes": text_bytes, "vision_tensors": len(heads) - len(text), "problems": problems}


def convert_checkpoint(src, dst, experts: str, max_shard_bytes: int = 5 * 2**30) -> dict:
    """Rewrites checkpoint `src` into `dst` with routed experts as "mxfp4" or "bf16", streaming: only the
    tensors of one output shard exist at a time. Other tensors are copied in the config's dtype; vision
    tensors are dropped (k3 is a text model). Returns `verify_checkpoint(dst)`.
    `dst` must be missing or empty: the checkpoint is written beside it and renamed into place when whole, so a
    failed or interrupted convert leaves no partial model (and never a mix with files that were there)."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("convert: OUT must differ from IN")
    check_new_out(dst, "convert")
    config = K3Config.from_pretrained(src)
    with staged_out(dst, "convert") as tmp:
        _write_converted(src, tmp, config, experts, max_shard_bytes)
    return verify_checkpoint(dst)


def _write_converted(src: Path, dst: Path, config: K3Config, experts: str, max_shard_bytes: int) -> None:
    float_dtype = config_float_dtype(config)
    heads = read_headers(src)
    plan = list(iter_plan(config, experts, float_dtype))
    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        if name not in heads:
            raise CheckpointError(f"{src}: missing tensor {name}")
        _, _, fname, raw = heads[name]
        if fname not in handles:
            handles.clear()  # one input file open at a time
            handles[fname] = safe_open(str(src / fname), framework="pt")
        try:
            return handles[fname].get_tensor(raw)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"corrupt shard {src / fname}: cannot read {raw}: {e}") from None

    def produce(spec) -> torch.Tensor:
        if spec.expert is None:
            return read(spec.name).to(_TORCH[spec.dtype]).contiguous()
        stem = spec.name.rsplit(".", 1)[0]
        if spec.kind == "weight":
            if stem + ".weight" in heads:
                return read(stem + ".weight").to(_TORCH[spec.dtype])
            return mxfp4_unpack(read(stem + ".weight_packed"), read(stem + ".weight_scale"), _TORCH[spec.dtype])
        if stem + ".weight_packed" in heads:
            return read(spec.name)
        packed, scale = mxfp4_pack(read(stem + ".weight"))
        return packed if spec.kind == "weight_packed" else scale

    groups = group_into_shards(plan, max_shard_bytes)
    weight_map, total = {}, 0
    from tqdm import tqdm
    # a bar on a terminal only (disable=None): piped or logged output stays the one summary line
    for i, specs in enumerate(tqdm(groups, desc=f"convert to {experts}", unit="shard", dynamic_ncols=True,
                                   leave=False, disable=None)):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {s.name: produce(s) for s in specs}
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})  # the whole directory is the temporary
        weight_map |= {s.name: fname for s in specs}
        total += sum(s.nbytes for s in specs)
        del tensors
    handles.clear()
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    config.replace(quantization_config=mxfp4_quantization_config() if experts == "mxfp4" else None).save(dst / "config.json")
    for extra in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json"):
        if (src / extra).is_file():
            (dst / extra).write_bytes((src / extra).read_bytes())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
