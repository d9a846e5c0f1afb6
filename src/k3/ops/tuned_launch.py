"""Launches of fla's autotuned Triton kernels with the autotuner's choice read once per key (for the lean inference
path, k3.ops.kda_fla_lean).

A launch `kernel[grid](**args)` of an fla kernel passes through up to three wrappers before Triton's JIT function:
`triton.heuristics` (a dict of every argument, per heuristic), fla's `CachedAutotuner.run` (an autotune key built
from a dict of every argument) and Triton's `Autotuner.run` (the same key again, `str(dtype)` per tensor, then
`Config.all_kwargs()`): on the host they cost more than the launch they wrap (benchmarks/host_cost_kda.py).
`TunedLaunch` does on its own what they do for a key the autotuner already holds: the heuristics evaluated per call,
the autotune key built as Triton builds it, the config read from the autotuner's cache (`Autotuner.cache`: Triton's
tuning, fla's config files and k3's pinned table all land there) with its keyword arguments merged once per key,
then the JIT function run with them: the same kernel, config and grid. A key the autotuner lacks goes through
the wrappers, so a new shape still autotunes; so does every kernel with a wrapper kind, a config pre-hook or an fla
cache mode (`FLA_CACHE_MODE=always` re-reads its files per call) whose behaviour this does not repeat, and every
kernel on a Triton series other than the one whose wrappers were read for this (`MIRRORED_TRITON`).

`lean_copy(fn)` copies an fla function with its autotuned kernels bound to such launchers. The copy reads the
module's other names as they were when it was made; fla's module itself is left as it is, so fla's public entries
(and k3 with K3_FLA_LEAN off) launch exactly as before.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types

import torch

__all__ = ["TunedLaunch", "lean_copy", "triton_mirrored", "MIRRORED_TRITON"]

_MISSING = object()
_NO_DTYPE = frozenset({type(None), bool, int, float, str})  # argument types without a `dtype` (skipped quickly)
_DTYPE_NAMES: dict = {}  # torch.dtype -> its str(), as the autotune key holds it


@functools.lru_cache(maxsize=None)
def _wrapper_kinds() -> tuple[type, tuple[type, ...]]:
    """(Triton's Heuristics, the autotuner classes whose `run` is mirrored here: Triton's and fla's)."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    tuners = [Autotuner]
    try:
        from fla.ops.utils.cache import CachedAutotuner
        tuners.append(CachedAutotuner)
    except ImportError:
        pass
    return Heuristics, tuple(tuners)


MIRRORED_TRITON = ((3, 6),)  # Triton series whose Autotuner.run and Heuristics.run `TunedLaunch` repeats
_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def triton_mirrored(version: str | None = None) -> bool:
    """Whether Triton (installed, or `version`) is a series whose wrappers are mirrored here; logged once when not
    (its kernels then launch through their wrappers)."""
    if version is None:
        import triton
        version = triton.__version__
    parts = version.split(".")[:2]
    ok = len(parts) == 2 and all(p.isdigit() for p in parts) and tuple(map(int, parts)) in MIRRORED_TRITON
    if not ok:
        _log.info("triton %s is not a series k3.ops.tuned_launch mirrors: fla's kernels launch through their "
                  "autotuner wrappers", version)
    return ok


def _fla_rereads_configs() -> bool:
    """fla's ALWAYS cache mode loads its config files on every call: its choice may change between calls."""
    try:
        from fla.ops.utils import cache
    except ImportError:
        return False
    return cache.FLA_CACHE_MODE is cache.FlaCacheMode.ALWAYS


class TunedLaunch:
    """`kernel[grid](*args, **kwargs)` for a `triton.heuristics`/autotuner-wrapped kernel, past the wrappers on a key
    the autotuner already holds. Kernels it cannot mirror launch through their wrappers (`direct` False)."""

    def __init__(self, kernel):
        heuristics, tuners = _wrapper_kinds()
        self.kernel, self.tuner, self.above, self.below = kernel, None, [], []
        self.direct, layer = triton_mirrored(), kernel
        while isinstance(layer, (heuristics, *tuners)):
            if type(layer) is heuristics:
                (self.below if self.tuner is not None else self.above).extend(layer.values.items())
            elif type(layer) in tuners and self.tuner is None:
                self.tuner = layer
            else:  # a subclass with its own run, or two autotuners: not mirrored
                self.direct = False
            layer = layer.fn
        self.jit = layer
        self.arg_names = list(kernel.arg_names)
        if self.tuner is not None:
            names = set(self.tuner.arg_names)
            self.arg_set = names
            self.keys = [k for k in self.tuner.keys if k in names]  # Triton keeps only keys that are arguments
            if type(self.tuner).__name__ == "CachedAutotuner" and _fla_rereads_configs():
                self.direct = False
            if len(self.tuner.configs) == 1 and self.tuner.configs[0].pre_hook is not None:
                self.direct = False
        self._merged: dict[tuple, tuple] = {}  # autotune key -> (its Config, the Config's keyword arguments)

    def __getattr__(self, name):  # anything else (`.run`, `.configs`, `.fn`) is the kernel's own
        if name == "kernel":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not self.direct:
            return self.kernel[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def autotune_key(self, named: dict) -> tuple:
        """Triton's autotune key (`Autotuner.run`): the key arguments' values, then each argument's `str(dtype)` for
        those that have one, in the arguments' order."""
        key = [named[k] for k in self.keys if k in named]
        names, dtype_names = self.arg_set, _DTYPE_NAMES
        for name, value in named.items():
            if type(value) in _NO_DTYPE or name not in names:
                continue
            dtype = getattr(value, "dtype", _MISSING)
            if dtype is not _MISSING:
                text = dtype_names.get(dtype) if type(dtype) is torch.dtype else None
                if text is None:
                    text = str(dtype)
                    if type(dtype) is torch.dtype:
                        dtype_names[dtype] = text
                key.append(text)
        return tuple(key)

    def chosen(self, named: dict):
        """The config the autotuner would launch with for these arguments and its keyword arguments, or None when it
        has none cached yet (or one with a pre-hook, which only the wrappers run)."""
        tuner = self.tuner
        if len(tuner.configs) == 1:
            key, config = (), tuner.configs[0]
        else:
            key = self.autotune_key(named)
            config = tuner.cache.get(key)
            if config is None or config.pre_hook is not None:
                return None
        merged = self._merged.get(key)
        if merged is None or merged[0] is not config:  # the first call on a key, or the cache was refilled
            merged = self._merged[key] = (config, config.all_kwargs())
        return merged

    def launch(self, grid, args: tuple, kwargs: dict):
        kwargs["grid"], kwargs["warmup"] = grid, False  # what `kernel[grid]` hands the wrappers
        given = dict(kwargs) if self.above else kwargs
        named = {**dict(zip(self.arg_names, args)), **kwargs} if args else kwargs
        for name, heuristic in self.above:  # as `Heuristics.run`: each sees the values set before it
            kwargs[name] = named[name] = heuristic(named)
        if self.tuner is not None:
            chosen = self.chosen(named)
            if chosen is None:  # a new key: the wrappers tune it (or load fla's or k3's choice)
                return self.kernel.run(*args, **given)
            config, config_kwargs = chosen
            self.tuner.best_config = config
            # the config's arguments beside the call's, as `Autotuner.run` passes them (a clash raises as there)
            if self.below:
                return self._run_below(*args, **kwargs, **config_kwargs)
            return self.jit.run(*args, **kwargs, **config_kwargs)
        return self.jit.run(*args, **kwargs)

    def _run_below(self, *args, **kwargs):
        """The heuristics under the autotuner (they may read the config's values), as `Heuristics.run`, then the JIT
        function."""
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        for name, heuristic in self.below:
            kwargs[name] = named[name] = heuristic(named)
        return self.jit.run(*args, **kwargs)


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (with its nested functions and comprehensions) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def lean_copy(fn, peel: dict | None = None):
    """A copy of function `fn` (its decorators peeled) whose global names that hold a wrapped Triton kernel hold a
    `TunedLaunch` of it instead, and whose callees named in `peel` (name -> their own `peel`) are such copies in turn
    (their decorators peeled: only dispatchers with no backend for this path may be named)."""
    heuristics, tuners = _wrapper_kinds()
    raw = inspect.unwrap(fn)
    scope = dict(raw.__globals__)
    for name in _names(raw.__code__):
        value = scope.get(name)
        if isinstance(value, (heuristics, *tuners)):
            scope[name] = TunedLaunch(value)
        elif peel and name in peel:
            scope[name] = lean_copy(value, peel[name])
    copy = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    copy.__kwdefaults__ = raw.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = raw.__qualname__, raw.__doc__, raw.__module__
    return copy
