"""Save and load a K3ForConditionalGeneration in the released layout: the text shards as `k3.checkpoint.hf`
writes them, plus one shard of the 165 + 3 vision tensors (`vision_tower.*`, `mm_projector.*`; BF16 as
released, never quantized), all in one index; config.json gains `vision_config` and
`media_placeholder_token_id` at the top level."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.checkpoint.hf import INDEX_NAME, CheckpointError, is_vision, open_shard, save_pretrained as save_text, shard_files
from k3.checkpoint.names import VISION_PREFIXES
from k3.config import K3Config
from k3.vision.config import VisionConfig

VISION_SHARD = "model-vision.safetensors"


def vision_state(model) -> dict[str, torch.Tensor]:
    """Released name → tensor for every vision tensor of the model."""
    out = {}
    for prefix, module in (("vision_tower.", model.vision_tower), ("mm_projector.", model.mm_projector)):
        for name, t in module.state_dict().items():
            out[prefix + name] = t
    return out


def _read_config(path) -> dict:
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON: {e}") from None


def has_vision(path) -> bool:
    d = _read_config(path)
    return isinstance(d, dict) and isinstance(d.get("vision_config"), dict)


def save_pretrained(model, path, dtype: torch.dtype | None = torch.bfloat16, **kwargs) -> None:
    """Text shards (kwargs go to k3.checkpoint.hf.save_pretrained: experts, max_shard_bytes), then the vision
    shard in `dtype` (bf16 as released; None keeps the model's dtype), then index and config."""
    out = Path(path)
    save_text(model.language_model, out, dtype=dtype, **kwargs)
    tensors = {n: t.detach().to(dtype or t.dtype).contiguous().cpu() for n, t in vision_state(model).items()}
    tmp = out / (VISION_SHARD + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / VISION_SHARD)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"].update({n: VISION_SHARD for n in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    cfg = _read_config(out)
    cfg["vision_config"] = model.vision_config.to_dict()
    cfg["media_placeholder_token_id"] = model.media_placeholder_token_id
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_pretrained(path, device="cpu", dtype: torch.dtype | None = None, language_model=None,
                    packed_experts: bool = False):
    """Builds the text model with k3.checkpoint.hf.load_pretrained and the vision modules from the same
    shards. Missing, unexpected and mis-shaped vision tensors are reported together in one CheckpointError.
    language_model: the text model to wrap instead (a serving rank's own part, k3.serve.expert_shard);
    packed_experts: keep MXFP4 experts packed (as k3.checkpoint.hf.load_pretrained)."""
    from k3.checkpoint.hf import load_pretrained as load_text
    from k3.vision.multimodal import MEDIA_PLACEHOLDER_TOKEN_ID, K3ForConditionalGeneration

    path = Path(path)
    top = _read_config(path)
    if not isinstance(top.get("vision_config"), dict):
        raise CheckpointError(f"{path}/config.json has no vision_config: it is a text-only model (use K3ForCausalLM)")
    vcfg = VisionConfig.from_dict(top["vision_config"])
    text_cfg = K3Config.from_dict(top)
    lm = language_model
    if lm is None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"skipped \d+ vision tensors")
            lm = load_text(path, device=device, dtype=dtype, packed_experts=packed_experts)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(text_cfg, vcfg, top.get("media_placeholder_token_id",
                                                                   MEDIA_PLACEHOLDER_TOKEN_ID), init=False)
    model.language_model = lm
    model.vision_tower.to_empty(device=device)
    model.mm_projector.to_empty(device=device)
    targets = vision_state(model)
    if dtype is not None:
        for t in targets.values():
            t.data = t.data.to(dtype)
    seen, problems = set(), []
    for f in shard_files(path):
        if not f.is_file():
            continue  # the text loader already reported missing shards
        with open_shard(f) as handle:
            for raw in handle.keys():
                if not is_vision(raw):
                    continue
                name = raw.removeprefix("language_model.") if not raw.startswith(VISION_PREFIXES) else raw
                if name not in targets:
                    problems.append(f"unexpected tensor {raw}")
                    continue
                seen.add(name)
                shape = tuple(handle.get_slice(raw).get_shape())
                if shape != tuple(targets[name].shape):
                    problems.append(f"{raw}: shape {shape}, expected {tuple(targets[name].shape)}")
                    continue
                with torch.no_grad():
                    targets[name].copy_(handle.get_tensor(raw))
    problems += [f"missing tensor {n}" for n in targets if n not in seen]
    if problems:
        shown = "\n  ".join(problems[:50])
        raise CheckpointError(f"checkpoint {path}: vision tensors do not match vision_config "
                              f"({len(problems)} problems):\n  {shown}")
    model.eval()
    return model
