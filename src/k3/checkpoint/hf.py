"""Save and load the released Hugging Face layout: config.json + sharded safetensors + index (unquantized)."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3.checkpoint.names import PREFIX, VISION_PREFIXES, a_log_len, export_tensors, is_f32, parse_name
from k3.config import K3Config


class CheckpointError(ValueError):
    """A checkpoint directory does not match what the config says it should hold."""


def save_pretrained(model, path, dtype: torch.dtype | None = torch.bfloat16, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `config.json`, `model-XXXXX-of-YYYYY.safetensors` shards and `model.safetensors.index.json`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in export_tensors(model.state_dict(), dtype):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = out / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg = model.config.replace(dtype=str(dtype or next(model.parameters()).dtype).removeprefix("torch."))
    cfg.save(out / "config.json")


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def load_pretrained(path, device="cpu", dtype: torch.dtype | None = None):
    """Builds the model on the meta device, then streams the shards into it one at a time.

    Accepts names with or without the `language_model.` prefix; skips vision tensors with a warning.
    All missing, unexpected, mis-shaped tensors are reported together in one CheckpointError."""
    from k3.model.decoder import K3ForCausalLM

    path = Path(path)
    config = K3Config.from_pretrained(path)
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    model.to_empty(device=device)
    if dtype is not None:
        for n, p in model.named_parameters():
            if not is_f32(n):
                p.data = p.data.to(dtype)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    seen: dict[str, set] = {n: set() for n in targets}
    problems, skipped_vision = [], 0
    for f in _shard_files(path):
        if not f.is_file():
            problems.append(f"shard file missing: {f.name}")
            continue
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read shard {f}: {e}") from None
        with handle:
            for raw in handle.keys():
                if raw.startswith(VISION_PREFIXES) or raw.startswith(PREFIX + "vision"):
                    skipped_vision += 1
                    continue
                name, expert, kind = parse_name(raw)
                # An expert index beyond num_experts is as unexpected as an unknown name (and would otherwise
                # surface as an IndexError from targets[name][expert]).
                if name not in targets or (expert is not None and expert >= targets[name].shape[0]):
                    problems.append(f"unexpected tensor {raw}")
                    continue
                if kind not in (None, "weight"):
                    problems.append(f"{raw}: quantized experts ({kind}) need the MXFP4 reader")
                    continue
                try:
                    t = handle.get_tensor(raw)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise CheckpointError(f"corrupt shard {f}: cannot read {raw}: {e}") from None
                dst = targets[name] if expert is None else targets[name][expert]
                # The tensor is present: even when it is rejected below, it must not be reported as missing too.
                seen[name].add(expert)
                if name.endswith("A_log"):
                    want = (a_log_len(dst.shape[0]),)
                    if tuple(t.shape) != want:
                        problems.append(f"{raw}: shape {tuple(t.shape)}, expected {want}")
                        continue
                    t = t[: dst.shape[0]]
                elif tuple(t.shape) != tuple(dst.shape):
                    problems.append(f"{raw}: shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
                    continue
                if not t.is_floating_point():
                    problems.append(f"{raw}: dtype {t.dtype}, expected a floating type")
                    continue
                with torch.no_grad():
                    dst.copy_(t)
    for name, t in targets.items():
        is_expert = name.endswith((".w1", ".w2", ".w3")) and ".experts." in name
        want = set(range(t.shape[0])) if is_expert else {None}
        missing = want - seen[name]
        if missing:
            what = f"experts {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''} of " if is_expert else ""
            problems.append(f"missing tensor {what}{PREFIX}{name}")
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise CheckpointError(f"checkpoint {path} does not match its config ({len(problems)} problems):\n  {shown}{more}")
    if skipped_vision:
        warnings.warn(f"skipped {skipped_vision} vision tensors (the text model does not use them)")
    model.eval()
    return model
