"""Save and load the released Hugging Face layout: config.json + sharded safetensors + index, with routed
experts either unquantized (`.weight`) or MXFP4 (`.weight_packed` + `.weight_scale`, SPEC §4)."""
from __future__ import annotations

import copy
import json
import os
import re
import warnings
import weakref
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3.checkpoint.names import PREFIX, VISION_PREFIXES, a_log_len, is_f32, parse_name
from k3.checkpoint.plan import ST_DTYPES, TensorSpec, check_experts_format, expert_stacks, group_into_shards, iter_plan
from k3.config import DTYPES, K3Config
from k3.memory import check_fits
from k3.ops.mx import BLOCK, mxfp4_pack, mxfp4_unpack

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory does not match what the config says it should hold."""


def mxfp4_quantization_config() -> dict:
    """SPEC §4's `quantization_config` (compressed-tensors, mxfp4-pack-quantized, routed experts only)."""
    return copy.deepcopy(K3Config.preset("kimi-k3").quantization_config)


def _is_packed(model) -> bool:
    return any(getattr(m, "packed", False) for m in model.modules())


def _float_dtype(model) -> torch.dtype:
    for n, p in model.named_parameters():
        if not is_f32(n) and p.is_floating_point():
            return p.dtype
    return torch.float32


class _Materializer:
    """Produces each planned tensor from the model's state; an expert matrix is packed once for both halves."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self._packed_key, self._packed = None, None

    def __call__(self, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        st = self.state
        if spec.expert is None:
            t = st[spec.source].detach()
            if spec.source.endswith("A_log"):
                padded = t.new_zeros(spec.shape[0], dtype=torch.float32)
                padded[: t.shape[0]] = t
                return padded
            return t.to(torch.float32 if spec.dtype == "F32" else dtype).contiguous()
        e = spec.expert
        if spec.kind == "weight":
            if spec.source in st:
                return st[spec.source][e].detach().to(dtype).contiguous()
            return mxfp4_unpack(st[spec.source + "_packed"][e], st[spec.source + "_scale"][e], dtype)
        if spec.source in st:  # float master weights: quantize now
            key = (spec.source, e)
            if key != self._packed_key:
                self._packed_key, self._packed = key, mxfp4_pack(st[spec.source][e].detach())
            return self._packed[0 if spec.kind == "weight_packed" else 1]
        suffix = "_packed" if spec.kind == "weight_packed" else "_scale"
        return st[spec.source + suffix][e].contiguous()


def save_pretrained(model, path, dtype: torch.dtype | None = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
                    experts: str | None = None) -> None:
    """Writes `config.json`, `model-XXXXX-of-YYYYY.safetensors` shards and `model.safetensors.index.json`.

    dtype: dtype of the tensors the release keeps in BF16 (None: the model's own float dtype).
    experts: "mxfp4" (packed E2M1 + E8M0 scales, quantization_config recorded) or "bf16" (unquantized, in
    `dtype`); None picks "mxfp4" for a model holding packed experts, else "bf16".
    Shards are filled in plan order up to max_shard_bytes; only one shard's tensors exist at a time."""
    if experts is None:
        experts = "mxfp4" if _is_packed(model) else "bf16"
    check_experts_format(experts)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    float_dtype = dtype or _float_dtype(model)
    plan = list(iter_plan(model.config, experts, float_dtype))
    shards: list[list[TensorSpec]] = group_into_shards(plan, max_shard_bytes)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    materialize = _Materializer(model.state_dict())
    weight_map, total = {}, 0
    for i, specs in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for spec in specs:
            t = materialize(spec, float_dtype).cpu()
            if tuple(t.shape) != spec.shape or ST_DTYPES.get(t.dtype) != spec.dtype:
                raise RuntimeError(f"internal: {spec.name} is {tuple(t.shape)} {t.dtype}, the plan says "
                                   f"{spec.shape} {spec.dtype}")
            tensors[spec.name] = t
            weight_map[spec.name] = fname
            total += spec.nbytes
        tmp = out / (fname + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    _remove_stale_shards(out, keep=set(weight_map.values()))
    cfg = model.config.replace(dtype=str(float_dtype).removeprefix("torch."),
                               quantization_config=mxfp4_quantization_config() if experts == "mxfp4" else None)
    cfg.save(out / "config.json")


# The shard names a save writes: k3's (and transformers') numbered shards, the single-file name, the vision shard.
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5}|-vision)?\.safetensors")


def _remove_stale_shards(out: Path, keep: set[str]) -> None:
    """Deletes the shards an earlier save left in `out` that this one did not write (say 5 shards saved over 3):
    tools that read every `*.safetensors` of a directory (llama.cpp's converter) would read them as tensors."""
    for f in out.iterdir():
        if _SHARD_NAME.fullmatch(f.name) and f.name not in keep and f.is_file():
            f.unlink()


def read_index(path: Path) -> dict | None:
    """The checkpoint's index (`model.safetensors.index.json`) as a dict, None where it has none. Its
    `weight_map` must map tensor names to shard files inside the directory: an absolute name, a `..` or a
    non-string (a hostile or broken index that would have the loader open files elsewhere) is a CheckpointError."""
    index = Path(path) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        idx = json.loads(index.read_text())
        weight_map = idx["weight_map"]
        names = weight_map.items()
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {type(e).__name__}: {e}") from None
    for name, fname in names:
        if not (isinstance(fname, str) and fname) or os.path.isabs(fname) or ".." in Path(fname).parts or "\\" in fname:
            raise CheckpointError(f"{index}: tensor {name!r} names shard {fname!r}, which is not a file inside "
                                  f"the checkpoint directory")
    return idx


def shard_files(path: Path) -> list[Path]:
    """The shard files a checkpoint directory declares (index) or holds (no index)."""
    idx = read_index(path)
    if idx is not None:
        return [path / f for f in sorted(set(idx["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def is_vision(raw: str) -> bool:
    return raw.startswith(VISION_PREFIXES) or raw.startswith(PREFIX + "vision") or raw.startswith(PREFIX + "mm_projector")


class _LiveBytes:
    """Counts bytes of tensors read from shards that are still alive (weakref finalizers), and the peak."""

    def __init__(self):
        self.live = self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, n)
        return t

    def _release(self, n: int) -> None:
        self.live -= n


def open_shard(f: Path):
    """A safetensors handle on one shard; an unreadable or truncated file is a CheckpointError naming it."""
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read shard {f}: {e}") from None


def load_pretrained(path, device="cpu", dtype: torch.dtype | str | None = None, packed_experts: bool = False,
                    stats: dict | None = None):
    """Builds the model on the meta device, then streams the shards into it one at a time.

    Routed experts may be stored unquantized (`experts.E.wN.weight`) or MXFP4 (`weight_packed` +
    `weight_scale`); by default MXFP4 experts are dequantized into float parameters. packed_experts=True keeps
    them packed (uint8 buffers; the model dequantizes one expert at a time in its forward) and packs any
    unquantized experts it reads. Accepts names with or without the `language_model.` prefix; skips vision
    tensors with a warning. All missing, unexpected, mis-shaped and mis-typed tensors are reported together in
    one CheckpointError; an unreadable shard raises a CheckpointError naming the file.
    stats: if a dict, receives `peak_live_bytes` (most bytes of tensors read from files alive at once),
    `largest_shard_bytes` and `skipped_vision`."""
    from k3.model.decoder import K3ForCausalLM
    from k3.ops.mx_experts import pack_experts_

    path = Path(path)
    config = K3Config.from_pretrained(path)
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: CUDA is not available here; load with device='cpu'")
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    if packed_experts:
        for m in model.modules():
            if hasattr(m, "w1") and hasattr(m, "packed"):
                pack_experts_(m, empty=True)
    if dtype is not None:
        for n, p in model.named_parameters():
            if not is_f32(n):
                p.data = p.data.to(dtype)
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    check_fits(f"loading {path} ({sum(p.numel() for p in model.parameters()):,} parameters)", need, device)
    model.to_empty(device=device)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    stacks = expert_stacks(config)
    seen: dict[str, set] = {n: set() for n in targets if n not in stacks and not n.endswith(("_packed", "_scale"))}
    expert_seen: dict[str, dict[int, set]] = {n: {} for n in stacks}  # stack → expert → kinds seen
    pending: dict[tuple, dict] = {}  # (stack, expert) → the half of a packed pair waiting for the other
    problems, skipped_vision, largest = [], 0, 0
    live = _LiveBytes()

    def put_expert(stack: str, e: int, kind: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if packed_experts:
                if kind == "weight":
                    packed, scale = mxfp4_pack(t)
                    targets[stack + "_packed"][e].copy_(packed)
                    targets[stack + "_scale"][e].copy_(scale)
                else:
                    targets[f"{stack}_{kind.removeprefix('weight_')}"][e].copy_(t)
            elif kind == "weight":
                targets[stack][e].copy_(t)
            else:
                half = pending.setdefault((stack, e), {})
                half[kind] = t
                if len(half) == 2:
                    del pending[(stack, e)]
                    w = targets[stack]
                    w[e].copy_(mxfp4_unpack(half["weight_packed"], half["weight_scale"], torch.float32).to(w.dtype))

    for f in shard_files(path):
        if not f.is_file():
            problems.append(f"shard file missing: {f.name}")
            continue
        largest = max(largest, f.stat().st_size)
        with open_shard(f) as handle:
            for raw in handle.keys():
                if is_vision(raw):
                    skipped_vision += 1
                    continue
                name, expert, kind = parse_name(raw)
                if expert is not None:
                    problem = _check_expert_header(handle, raw, stacks.get(name), expert, kind)
                    if problem:
                        problems.append(problem)
                        continue
                    kinds = expert_seen[name].setdefault(expert, set())
                    had_both = "weight" in kinds and len(kinds) > 1
                    kinds.add(kind)
                    if "weight" in kinds and len(kinds) > 1:
                        if not had_both:  # once per expert matrix
                            problems.append(f"{raw.rsplit('.', 1)[0]}: expert stored both unquantized (.weight) "
                                            f"and as MXFP4 (.weight_packed/.weight_scale)")
                        continue
                    put_expert(name, expert, kind, live.track(_read(handle, f, raw)))
                    continue
                if name not in seen:
                    problems.append(f"unexpected tensor {raw}")
                    continue
                seen[name].add(None)  # present: even when rejected below, it is not reported as missing too
                dst = targets[name]
                sl = handle.get_slice(raw)
                shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
                want = (a_log_len(dst.shape[0]),) if name.endswith("A_log") else tuple(dst.shape)
                if shape != want:
                    problems.append(f"{raw}: shape {shape}, expected {want}")
                    continue
                if st_dtype not in ("F32", "BF16", "F16", "F64"):
                    problems.append(f"{raw}: dtype {st_dtype}, expected a floating type")
                    continue
                t = live.track(_read(handle, f, raw))
                if name.endswith("A_log"):
                    t = t[: dst.shape[0]]
                with torch.no_grad():
                    dst.copy_(t)
                del t
    for name, got in seen.items():
        if None not in got:
            problems.append(f"missing tensor {PREFIX}{name}")
    for stack, (E, _, _) in stacks.items():
        done = expert_seen[stack]
        missing = [e for e in range(E) if not ({"weight"} <= done.get(e, set())
                                               or {"weight_packed", "weight_scale"} <= done.get(e, set()))]
        if missing:
            more = "..." if len(missing) > 5 else ""
            problems.append(f"missing tensor experts {missing[:5]}{more} of {PREFIX}{stack}")
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise CheckpointError(f"checkpoint {path} does not match its config ({len(problems)} problems):\n  {shown}{more}")
    if skipped_vision:
        warnings.warn(f"skipped {skipped_vision} vision tensors (the text model does not use them)")
    if stats is not None:
        stats.update(peak_live_bytes=live.peak, largest_shard_bytes=largest, skipped_vision=skipped_vision)
    model.eval()
    return model


def resolve_dtype(dtype, config: K3Config) -> torch.dtype | None:
    """from_pretrained's dtype: a torch float dtype, its name ("bfloat16", "torch.float16"), "auto" (the
    config's `dtype`) or None (float32); anything else is a ValueError naming the choices."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str):
        name = config.dtype if dtype == "auto" else dtype.removeprefix("torch.")
        if name in DTYPES:
            return getattr(torch, name)
    raise ValueError(f"dtype={dtype!r}: expected a torch float dtype, one of {', '.join(DTYPES)}, 'auto' (the "
                     f"config's dtype) or None (float32)")


def _read(handle, f: Path, raw: str) -> torch.Tensor:
    try:
        return handle.get_tensor(raw)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"corrupt shard {f}: cannot read {raw}: {e}") from None


def _check_expert_header(handle, raw: str, stack, expert: int, kind: str) -> str | None:
    """Problem text for an expert tensor that does not fit its stack (from the header alone), else None."""
    if stack is None or expert >= stack[0]:
        return f"unexpected tensor {raw}"
    _, out, inp = stack
    sl = handle.get_slice(raw)
    shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
    if kind == "weight":
        want, dtypes = (out, inp), ("F32", "BF16", "F16", "F64")
    else:
        want = (out, inp // 2) if kind == "weight_packed" else (out, inp // BLOCK)
        dtypes = ("U8",)
    if shape != want:
        return f"{raw}: shape {shape}, expected {want}"
    if st_dtype not in dtypes:
        return f"{raw}: dtype {st_dtype}, expected {' or '.join(dtypes)}"
    return None
