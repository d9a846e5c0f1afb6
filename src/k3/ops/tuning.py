"""Autotune choices shipped with k3: each Triton autotuned kernel k3 runs is pinned, before its first call, to the
config a GPU of the same name chose for the same key, so a fresh machine compiles one config per kernel instead
of benchmarking (and compiling) every candidate.

The table (`autotune_table.json` beside this file; `K3_AUTOTUNE_TABLE=PATH` another, `off` none) holds, per GPU
name (`torch.cuda.get_device_name`) and fla version, kernel name -> [{key, config}] (and the GPU's architecture and SM
count, `arch` and `sms`: a GPU the table does not name borrows the section of its architecture with the nearest SM
count, so an H100 starts from the H200's choices instead of autotuning for minutes):
- kernel: `module.attribute` of an autotuned kernel in `fla.ops`, `fla.modules` or `k3.ops` (no other module is
  ever imported on a table's word);
- key: Triton's autotune key for a call (the key arguments' values, then each tensor argument's dtype);
- config: kwargs, num_warps, num_stages, num_ctas, maxnreg, and it must equal one of the kernel's own candidates,
  so a pinned kernel runs a config its authors ship (and the table cannot make up launch parameters).
Pinning fills `Autotuner.cache[key]`, the dict Triton consults before tuning: a call with another key, a kernel
with no entry, a GPU or fla version the table lacks all autotune as before. A malformed table fails with one line
naming the file and the field. `k3 tune` regenerates this GPU's section (`record` + `merge` + `save`).
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from k3 import envs
from k3.ops import precompile

__all__ = ["TABLE_PATH", "FORMAT", "TableError", "load_table", "read_table", "parse_table", "resolve_kernel",
           "resolve_jit_function", "pin", "record", "record_compiles", "merge", "save", "tune", "table_path",
           "pin_for_device", "pinned_count", "fla_version", "hardware_of", "section_for"]

TABLE_PATH = Path(__file__).with_name("autotune_table.json")
FORMAT = "k3-autotune-table/1"
KERNEL_PREFIXES = ("fla.ops.", "fla.modules.", "k3.ops.")  # the only packages a table may name kernels in
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")
SPEC_FIELDS = ("name", "signature", "constant_keys", "constant_vals", "attrs_keys", "attrs_vals", "options", "key")
MAX_TABLE_BYTES = 4 << 20
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_log = logging.getLogger(__name__)
_pinned_devices: dict[int, int] = {}  # CUDA device index -> number of choices pinned there


class TableError(ValueError):
    """A table file that is not a valid autotune table (the message names the file and the field)."""


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))


def _check_config(config, where: str) -> dict:
    if not isinstance(config, dict):
        raise TableError(f"{where}: must be an object with {list(CONFIG_FIELDS)}, got {type(config).__name__}")
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise TableError(f"{where}: unknown field(s) {unknown}; a config has {list(CONFIG_FIELDS)}")
    kwargs = config.get("kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and _scalar(v) for k, v in kwargs.items()):
        raise TableError(f"{where}.kwargs: must map parameter names to numbers, booleans or strings")
    for field in ("num_warps", "num_stages", "num_ctas"):
        value = config.get(field, 1)
        if type(value) is not int or not 0 <= value <= 64:
            raise TableError(f"{where}.{field}: must be an integer in [0, 64], got {value!r}")
    maxnreg = config.get("maxnreg")
    if maxnreg is not None and (type(maxnreg) is not int or not 0 < maxnreg <= 65536):
        raise TableError(f"{where}.maxnreg: must be null or a positive integer, got {maxnreg!r}")
    return {"kwargs": dict(kwargs), "num_warps": config.get("num_warps", 4), "num_stages": config.get("num_stages", 3),
            "num_ctas": config.get("num_ctas", 1), "maxnreg": maxnreg}


def _check_compile(spec, where: str) -> dict:
    """One compile of the table: Triton's specialisation data (JITFunction.preload's input) for a kernel of
    KERNEL_PREFIXES, with no IR override (a table never supplies code)."""
    if not isinstance(spec, dict) or set(spec) != set(SPEC_FIELDS):
        raise TableError(f"{where}: must be an object with exactly {list(SPEC_FIELDS)}")
    name = spec["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name) or not name.startswith(KERNEL_PREFIXES):
        raise TableError(f"{where}.name: {name!r} is not a kernel of {list(KERNEL_PREFIXES)}")
    for field, kind in (("signature", dict), ("options", dict), ("constant_keys", list), ("constant_vals", list),
                        ("attrs_keys", list), ("attrs_vals", list)):
        if not isinstance(spec[field], kind):
            raise TableError(f"{where}.{field}: must be a{'n object' if kind is dict else ' list'}")
    if spec["options"].get("ir_override") is not None or "extern_libs" in spec["options"]:
        raise TableError(f"{where}.options: ir_override and extern_libs are not taken from a table")
    return spec


def parse_table(data, source: str = "<table>") -> dict[str, dict]:
    """Validate a decoded table: {gpu name: {"fla": version, "kernels": {kernel: [(key tuple, config dict)]}}}.
    Checks structure and types only; `pin` checks each entry against its kernel."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{source}: not an autotune table (format must be {FORMAT!r})")
    unknown = sorted(set(data) - {"format", "gpus"})
    if unknown:
        raise TableError(f"{source}: unknown top-level field(s) {unknown}")
    gpus = data.get("gpus", {})
    if not isinstance(gpus, dict):
        raise TableError(f"{source}: gpus must be an object keyed by GPU name")
    parsed = {}
    for gpu, section in gpus.items():
        where = f"{source}: gpus[{gpu!r}]"
        if not isinstance(section, dict) or not isinstance(section.get("kernels"), dict):
            raise TableError(f"{where}: must be an object with a 'kernels' object")
        unknown = sorted(set(section) - {"fla", "triton", "made_by", "arch", "sms", "kernels", "compiles"})
        if unknown:
            raise TableError(f"{where}: unknown field(s) {unknown}")
        for field in ("fla", "triton", "made_by", "arch"):
            if not isinstance(section.get(field, ""), str):
                raise TableError(f"{where}.{field}: must be a string")
        sms = section.get("sms", 0)
        if type(sms) is not int or sms < 0:
            raise TableError(f"{where}.sms: must be a count of SMs")
        kernels = {}
        for kernel, entries in section["kernels"].items():
            if not _NAME.fullmatch(kernel) or not kernel.startswith(KERNEL_PREFIXES):
                raise TableError(f"{where}.kernels: {kernel!r} is not a kernel of {list(KERNEL_PREFIXES)}")
            if not isinstance(entries, list):
                raise TableError(f"{where}.kernels[{kernel!r}]: must be a list of {{key, config}}")
            checked = []
            for i, entry in enumerate(entries):
                at = f"{where}.kernels[{kernel!r}][{i}]"
                if not isinstance(entry, dict) or set(entry) != {"key", "config"}:
                    raise TableError(f"{at}: must be an object with exactly 'key' and 'config'")
                key = entry["key"]
                if not isinstance(key, list) or not all(_scalar(v) for v in key):
                    raise TableError(f"{at}.key: must be a list of numbers, booleans, strings or nulls")
                checked.append((tuple(key), _check_config(entry["config"], f"{at}.config")))
            kernels[kernel] = checked
        compiles = section.get("compiles", [])
        if not isinstance(compiles, list):
            raise TableError(f"{where}.compiles: must be a list of Triton specialisations")
        parsed[gpu] = {"fla": section.get("fla", ""), "triton": section.get("triton", ""),
                       "arch": section.get("arch", ""), "sms": sms, "kernels": kernels,
                       "compiles": [_check_compile(c, f"{where}.compiles[{i}]") for i, c in enumerate(compiles)]}
    return parsed


def _reject_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def load_table(path: str | os.PathLike) -> dict[str, dict]:
    """Read and validate a table file, parsed as `parse_table` returns it."""
    return parse_table(read_table(path), str(path))


def read_table(path: str | os.PathLike) -> dict:
    """A table file's JSON, once it validates; a missing, oversized or undecodable file is a TableError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TABLE_BYTES + 1)
    except OSError as e:
        raise TableError(f"{path}: cannot read the autotune table ({e.strerror or e})") from None
    if len(raw) > MAX_TABLE_BYTES:
        raise TableError(f"{path}: larger than {MAX_TABLE_BYTES} bytes, not an autotune table")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TableError(f"{path}: not valid JSON ({str(e).splitlines()[0][:200]})") from None
    parse_table(data, str(path))
    return data


def _unwrap(obj, is_it):
    """The object in `obj`'s chain of `.fn` (autotuner, heuristics, JIT function) that `is_it` accepts, or None."""
    try:
        for _ in range(4):
            if is_it(obj):
                return obj
            obj = getattr(obj, "fn", None)
            if obj is None:
                return None
    except Exception:  # a module attribute with a strange __getattr__ is no kernel
        return None
    return None


def _autotuner_of(obj):
    """The Autotuner in a kernel object (it may sit under @triton.heuristics), or None."""
    return _unwrap(obj, lambda o: all(hasattr(o, a) for a in ("cache", "configs", "keys", "arg_names"))
                   and isinstance(o.cache, dict))


def _jit_function_of(obj):
    """The JITFunction in a kernel object (under any autotuner or heuristics), or None."""
    return _unwrap(obj, lambda o: hasattr(o, "preload") and hasattr(o, "device_caches"))


def _resolve(name: str, find, what: str):
    """find(the attribute) for kernel `module.attribute`, importing the module, which must lie in
    KERNEL_PREFIXES (a table never makes k3 import anything else)."""
    module_name, _, attr = name.rpartition(".")
    if not name.startswith(KERNEL_PREFIXES) or not _NAME.fullmatch(name):
        raise TableError(f"unknown kernel {name!r}: not in {list(KERNEL_PREFIXES)}")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise TableError(f"unknown kernel {name!r}: module {module_name} does not import") from None
    found = find(getattr(module, attr, None))
    if found is None:
        raise TableError(f"unknown kernel {name!r}: {module_name} has no {what} {attr!r}")
    return found


def resolve_kernel(name: str):
    """The Autotuner of kernel `module.attribute`."""
    return _resolve(name, _autotuner_of, "autotuned kernel")


def resolve_jit_function(name: str):
    """The JITFunction of kernel `module.attribute` (what JITFunction.preload compiles)."""
    return _resolve(name, _jit_function_of, "Triton kernel")


def record_compiles(step, prefixes=KERNEL_PREFIXES) -> list[dict]:
    """The Triton compiles `step` needs, in the order it first needs them, as specialisation data for
    `JITFunction.preload`. Run it where every autotuned kernel is already tuned or pinned: each kernel's
    in-process binaries are dropped first, so `step` loads again (from Triton's disk cache) each one it runs, and
    Triton's post-compile hook sees it."""
    from triton import knobs

    seen = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(prefixes):
            for obj in list(vars(module).values()):
                fn = _jit_function_of(obj)
                if fn is not None:
                    fn.device_caches.clear()

    def hook(*, compile, **_):
        spec = json.loads(compile["specialization_data"])
        spec["options"].pop("extern_libs", None)  # this machine's libdevice path: the loader's default
        if _NAME.fullmatch(spec["name"]) and spec["name"].startswith(KERNEL_PREFIXES):  # a module-level kernel
            seen.setdefault(json.dumps(spec, sort_keys=True), spec)
    saved, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    try:
        step()
    finally:
        knobs.runtime.jit_post_compile_hook = saved
    return list(seen.values())


def _as_dict(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def pin(kernels: dict[str, list], resolve=resolve_kernel, source: str = "<table>") -> int:
    """Pin each (key, config) of `kernels` (one GPU section's "kernels" from `parse_table`) into its kernel's
    autotune cache; a key the process already tuned keeps its own result. Every entry is checked before any is
    pinned: a config must name only the kernel's parameters and equal one of its candidates. Returns the count."""
    plan = []
    for name, entries in kernels.items():
        tuner = resolve(name)
        params = set(tuner.arg_names)
        candidates = [(_as_dict(c), c) for c in tuner.configs]
        for i, (key, config) in enumerate(entries):
            at = f"{source}: kernel {name!r} entry {i}"
            stray = sorted(set(config["kwargs"]) - params)
            if stray:
                raise TableError(f"{at}: config field(s) {stray} are not parameters of the kernel")
            if len(key) > len(tuner.keys) + len(params):  # key arguments, then at most one dtype per argument
                raise TableError(f"{at}: key {list(key)} is longer than the kernel's autotune key can be")
            match = next((c for d, c in candidates if d == config), None)
            if match is None:
                raise TableError(f"{at}: config {config} is not one of the kernel's {len(candidates)} candidates")
            plan.append((tuner, key, match))
    for tuner, key, config in plan:
        tuner.cache.setdefault(key, config)
    return len(plan)


def record(prefixes=KERNEL_PREFIXES) -> dict[str, list]:
    """This process's autotune results, as a table section's "kernels": every autotuned kernel (more than one
    candidate) of an imported module under `prefixes`, with the config chosen for each key it tuned."""
    kernels = {}
    for module_name, module in sorted(list(sys.modules.items()), key=lambda item: item[0]):
        if module is None or not module_name.startswith(prefixes):
            continue
        for attr, obj in sorted(vars(module).items(), key=lambda item: item[0]):
            tuner = _autotuner_of(obj)
            if tuner is None or len(tuner.configs) < 2 or not tuner.cache:
                continue
            if getattr(getattr(tuner, "base_fn", None), "__module__", module_name) != module_name:
                continue  # imported from elsewhere: recorded under the module that defines it
            entries = [{"key": list(key), "config": _as_dict(config)} for key, config in tuner.cache.items()
                       if all(_scalar(v) for v in key) and all(_scalar(v) for v in config.kwargs.values())]
            if entries:
                kernels[f"{module_name}.{attr}"] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    return kernels


def merge(table: dict | None, gpu: str, kernels: dict[str, list], made_by: str = "",
          compiles: list[dict] | None = None, hardware: tuple[str, int] = ("", 0)) -> dict:
    """A table (JSON, as `read_table` returns) with `kernels` and `compiles` added to `gpu`'s section (and its
    `hardware`, (arch, SMs) as `hardware_of` gives them, where known): a key
    tuned again takes the new choice, other keys and shapes stay; a kernel's compiles recorded with other
    parameters than its new ones go. A section made with another fla version is replaced whole; other GPUs'
    sections are kept."""
    table = {"format": FORMAT, "gpus": dict((table or {}).get("gpus", {}))}
    old = table["gpus"].get(gpu)
    if old is None or old.get("fla") != fla_version():
        old = {"kernels": {}, "compiles": [], "made_by": ""}
    merged = {name: {json.dumps(e["key"]): e for e in entries} for name, entries in old["kernels"].items()}
    for name, entries in kernels.items():
        merged.setdefault(name, {}).update({json.dumps(e["key"]): e for e in entries})
    # an old compile of a kernel whose parameters have changed since (a new spec of that name lists others) is
    # dropped: kept, it would fail in every precompile worker
    params = {c["name"]: list(c["signature"]) for c in compiles or []}
    kept = [c for c in old.get("compiles", []) if params.get(c["name"], list(c["signature"])) == list(c["signature"])]
    specs = {json.dumps(c, sort_keys=True): c for c in [*kept, *(compiles or [])]}
    made = [m for m in old["made_by"].split("; ") if m and m != made_by] + [made_by]
    arch, sms = hardware if hardware[0] else (old.get("arch", ""), old.get("sms", 0))
    table["gpus"][gpu] = {"fla": fla_version(), "triton": _triton_version(), "made_by": "; ".join(made),
                          **({"arch": arch, "sms": sms} if arch else {}),
                          "kernels": {name: [entries[k] for k in sorted(entries)]
                                      for name, entries in sorted(merged.items())},
                          "compiles": list(specs.values())}
    return table


def save(table: dict, path: str | os.PathLike) -> None:
    """Write `table` atomically (a temporary file beside it, then a rename), after checking it is valid."""
    parse_table(table, str(path))
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)  # in order: a specialisation's signature lists the parameters in order
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def tune(preset: str, batch: int, seq: int, path: str | os.PathLike, device: str = "cuda",
         autocast: bool = False) -> tuple[str, int]:
    """`k3 tune`: autotune every kernel of one training step (forward and backward) of `preset` at batch x seq
    on this GPU, pinning nothing, then add the choices and the compiles they need to `path`'s section for this
    GPU (`merge`). autocast: the step as `k3 train` runs it, fp32 weights under bf16 autocast (the tensors' dtypes
    are part of the autotune keys); else bf16 weights, as the GPU benchmarks. Returns (GPU name, kernels)."""
    import torch

    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM

    old = read_table(path) if Path(path).exists() else None  # a file it may not replace fails before the work
    config = K3Config.preset(preset)
    with envs.override(autotune_table="off"):
        with torch.device(device):
            model = K3ForCausalLM(config)
        model = model.train() if autocast else model.to(torch.bfloat16).train()
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
        step()  # tunes
        compiles = record_compiles(step)  # the chosen configs' compiles, for precompiling
    gpu = torch.cuda.get_device_name(device)
    kernels = record()
    made_by = f"k3 tune --preset {preset} --batch-size {batch} --seq-len {seq}" + (" --autocast" if autocast else "")
    save(merge(old, gpu, kernels, made_by, compiles, hardware_of(device)), path)
    return gpu, len(kernels)


def hardware_of(device) -> tuple[str, int]:
    """(architecture as "sm_XY", SM count) of a CUDA device: what decides whether another GPU's choices fit it."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"sm_{props.major}{props.minor}", props.multi_processor_count


def section_for(table: dict[str, dict], gpu: str, hardware: tuple[str, int]) -> tuple[str, dict] | None:
    """(name, section) of the parsed table that a GPU named `gpu` pins from: its own; else, among the sections
    recorded on its architecture (`hardware`: (arch, SMs)), the one with the nearest SM count (the configs are
    the same kernels' own candidates, compiled for the same target; tuned on another card they may run a few
    percent off, where autotuning would cost minutes); else None."""
    if gpu in table:
        return gpu, table[gpu]
    arch, sms = hardware
    same = [(abs(s["sms"] - sms), name) for name, s in table.items() if arch and s["arch"] == arch]
    if not same:
        return None
    _, nearest = min(same)  # (ties: the first name in order)
    return nearest, table[nearest]


def fla_version() -> str:
    fla = sys.modules.get("fla")
    if fla is None:
        try:
            import fla
        except Exception:  # no fla, or triton failing to start without a GPU
            return ""
    return getattr(fla, "__version__", "")


def _triton_version() -> str:
    try:
        import triton
    except Exception:
        return ""
    return triton.__version__


def table_path() -> Path | None:
    """The table this process pins from: K3_AUTOTUNE_TABLE's path, None for `off`, else the shipped one."""
    setting = envs.current().autotune_table
    if setting == "off":
        return None
    return Path(setting) if setting else TABLE_PATH


def pin_for_device(device) -> int:
    """Pin the table's choices for `device`'s GPU and start compiling its kernels ahead in worker processes
    (k3.ops.precompile), once per device per process (cheap after the first call): call it early (before building
    the model) for the most overlap. Returns how many choices were pinned. A GPU or fla version the table lacks
    pins nothing (Triton autotunes). A table named by K3_AUTOTUNE_TABLE that does not fit fails with a
    TableError; the shipped one that does not fit this install (a patched fla) is logged and left out."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index in _pinned_devices:
        return _pinned_devices[index]
    _pinned_devices[index] = 0
    path = table_path()
    if path is None:
        return 0
    gpu = torch.cuda.get_device_name(index)
    try:
        found = section_for(load_table(path), gpu, hardware_of(index))
        if found is None:
            _log.info("autotune table %s has no choices for %s or its architecture: Triton autotunes", path, gpu)
            return 0
        source, section = found
        if source != gpu:
            _log.info("autotune table %s has no choices for %s: pinning those of %s (the same architecture, %s)",
                      path, gpu, source, section["arch"])
        if section["fla"] != fla_version():
            _log.info("autotune table %s was made with fla %s, this is fla %s: Triton autotunes", path,
                      section["fla"] or "-", fla_version() or "-")
            return 0
        workers = precompile.start(section["compiles"])  # first: the workers take seconds to start
        count = _pinned_devices[index] = pin(section["kernels"], source=str(path))
    except TableError as e:
        if path != TABLE_PATH:
            raise
        _log.warning("k3's autotune table does not fit this install, Triton autotunes: %s", e)
        return 0
    _log.info("pinned %d autotune choices for %s from %s; %d kernels compiling ahead in %d processes", count, gpu,
              path, len(section["compiles"]), len(workers))
    return count


def pinned_count(device_index: int = 0) -> int:
    return _pinned_devices.get(device_index, 0)
