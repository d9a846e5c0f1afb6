"""k3.ops.tuned_launch: fla's autotuned kernels launched past their wrappers on keys the autotuner already holds.

With Triton's own Autotuner and Heuristics around a stand-in for the JIT function that records what reaches it: a
launch through TunedLaunch hands the JIT function exactly what the wrappers hand it (config, grid, heuristic values,
arguments) and benchmarks nothing; a new value of a key argument or a new dtype is tuned by the wrappers; a pinned
or refilled cache entry is what launches; wrappers it does not mirror are gone through. With fla 0.6 importable
(on CUDA, else under the Triton interpreter): the lean stages' copies launch fla's real kernels with the
autotuner's choices and bit-identical outputs, and fla's modules keep their own kernel objects.
Skipped where triton is not installed.
"""
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: before triton's users import
pytest.importorskip("triton")

from triton import Config  # noqa: E402
from triton.runtime.autotuner import Autotuner, Heuristics  # noqa: E402

from k3.ops import kda_fla_lean  # noqa: E402
from k3.ops.tuned_launch import TunedLaunch, lean_copy  # noqa: E402

PARAMS = ["x", "y", "n", "n_cols", "BLOCK", "EVEN"]
CONFIGS = [Config({"BLOCK": 32}, num_warps=4), Config({"BLOCK": 64}, num_warps=2),
           Config({"BLOCK": 128}, num_warps=8, num_stages=2)]


class RecordingJIT:
    """Stands in for a JIT function: records what each launch hands it (tensors by identity), runs nothing."""

    def __init__(self, params=PARAMS):
        def kernel():
            pass
        self.fn, self.arg_names, self.launches, self.benching = kernel, list(params), [], False

    def run(self, *args, grid, warmup, **kwargs):
        ident = lambda v: ("tensor", id(v)) if isinstance(v, torch.Tensor) else v  # noqa: E731
        self.launches.append(dict(args=tuple(map(ident, args)), grid=grid, warmup=warmup, bench=self.benching,
                                  **{k: ident(v) for k, v in kwargs.items()}))

    def bench(self, kernel_call, quantiles):
        """A benchmark where the config whose BLOCK is nearest the argument `n` wins: keys choose differently."""
        self.benching = True
        try:
            kernel_call()
        finally:
            self.benching = False
        last = self.launches[-1]
        n = last["n"] if "n" in last else last["args"][2]
        return [float(abs(last["BLOCK"] - n))] * 3

    def take(self) -> list[dict]:
        out, self.launches = self.launches, []
        return out


def autotuned(jit, configs=CONFIGS, tuner_class=Autotuner, heuristics=True):
    """`@triton.heuristics(EVEN) @triton.autotune(configs, key=["n"])` around `jit`: (kernel, its autotuner)."""
    tuner = tuner_class(jit, jit.arg_names, configs, ["n"], None, None, do_bench=jit.bench)
    if not heuristics:
        return tuner, tuner
    return Heuristics(tuner, tuner.arg_names, {"EVEN": lambda args: args["n_cols"] % 2 == 0}), tuner


def tensors():
    return torch.zeros(4), torch.zeros(4, dtype=torch.float16)


def test_a_held_key_launches_what_the_wrappers_launch_without_tuning():
    jit = RecordingJIT()
    kernel, tuner = autotuned(jit)
    x, y = tensors()
    kernel[(3, 2)](x=x, y=y, n=64, n_cols=7)  # the wrappers tune the key
    tuned = jit.take()
    assert [r["BLOCK"] for r in tuned if r["bench"]] == [32, 64, 128]
    assert tuner.cache == {(64, "torch.float32", "torch.float16"): CONFIGS[1]}  # n, then each tensor's dtype
    reference = tuned[-1]
    assert not reference["bench"] and reference["BLOCK"] == 64 and reference["num_warps"] == 2

    fast = TunedLaunch(kernel)
    assert fast.direct and fast.autotune_key(dict(x=x, y=y, n=64, n_cols=7)) in tuner.cache
    assert fast.values is kernel.values and fast.run == kernel.run  # other attributes are the kernel's
    wrapper_runs = []
    for layer in (kernel, tuner):
        layer.run = lambda *a, _run=layer.run, **k: wrapper_runs.append(a) or _run(*a, **k)
    for _ in range(3):
        fast[(3, 2)](x=x, y=y, n=64, n_cols=7)
    assert jit.take() == [reference] * 3  # same config, grid, heuristic value and arguments; nothing benchmarked
    assert not wrapper_runs  # past the wrappers
    tuner.best_config = None
    fast[(3, 2)](x=x, y=y, n=64, n_cols=7)
    assert tuner.best_config is CONFIGS[1]  # as Autotuner.run leaves it


def test_a_new_key_or_dtype_is_tuned_then_each_key_keeps_its_choice():
    jit = RecordingJIT()
    kernel, tuner = autotuned(jit)
    fast = TunedLaunch(kernel)
    x, y = tensors()
    fast[(1,)](x=x, y=y, n=64, n_cols=2)
    fast[(1,)](x=x, y=y, n=128, n_cols=2)  # a new value of the key argument
    fast[(1,)](x=x, y=y.float(), n=64, n_cols=2)  # a new dtype
    launched = jit.take()
    assert [r["BLOCK"] for r in launched if r["bench"]] == [32, 64, 128] * 3
    assert [r["BLOCK"] for r in launched if not r["bench"]] == [64, 128, 64]
    assert len(tuner.cache) == 3
    for n in (128, 64, 128):
        fast[(1,)](x=x, y=y, n=n, n_cols=2)
    held = jit.take()
    assert [r["BLOCK"] for r in held] == [128, 64, 128] and not any(r["bench"] for r in held)
    assert [r["num_warps"] for r in held] == [8, 2, 8] and [r["num_stages"] for r in held] == [2, 3, 2]


def test_heuristics_are_evaluated_on_every_launch():
    """A heuristic may read an argument outside the autotune key: one key, two values."""
    jit = RecordingJIT()
    kernel, _ = autotuned(jit)
    fast = TunedLaunch(kernel)
    x, y = tensors()
    for n_cols in (7, 8, 9):
        kernel[(1,)](x=x, y=y, n=64, n_cols=n_cols)
    reference = [r for r in jit.take() if not r["bench"]]
    for n_cols in (7, 8, 9):
        fast[(1,)](x=x, y=y, n=64, n_cols=n_cols)
    launched = jit.take()
    assert launched == reference and [r["EVEN"] for r in launched] == [False, True, False]


def test_positional_arguments_launch_as_through_the_wrappers():
    jit = RecordingJIT()
    kernel, _ = autotuned(jit)
    x, y = tensors()
    kernel[(5,)](x, y, 128, 3)
    reference = jit.take()[-1]
    TunedLaunch(kernel)[(5,)](x, y, 128, 3)
    assert jit.take() == [reference] and reference["args"][2] == 128 and reference["BLOCK"] == 128


def test_a_pinned_or_refilled_cache_entry_is_what_launches():
    """k3's pinned table fills Autotuner.cache before the first call; whatever the cache holds for a key launches,
    and a cleared cache tunes again."""
    jit = RecordingJIT()
    kernel, tuner = autotuned(jit)
    fast = TunedLaunch(kernel)
    x, y = tensors()
    key = (64, "torch.float32", "torch.float16")
    tuner.cache[key] = CONFIGS[2]  # pinned: not what the benchmark would choose
    fast[(1,)](x=x, y=y, n=64, n_cols=1)
    assert [(r["BLOCK"], r["bench"]) for r in jit.take()] == [(128, False)]
    tuner.cache[key] = CONFIGS[0]
    fast[(1,)](x=x, y=y, n=64, n_cols=1)
    assert [(r["BLOCK"], r["bench"]) for r in jit.take()] == [(32, False)]
    tuner.cache.clear()
    fast[(1,)](x=x, y=y, n=64, n_cols=1)
    assert [(r["BLOCK"], r["bench"]) for r in jit.take()] == [(32, True), (64, True), (128, True), (64, False)]


def test_heuristics_under_the_autotuner_see_the_config():
    jit = RecordingJIT(PARAMS + ["HALF"])
    below = Heuristics(jit, jit.arg_names, {"HALF": lambda args: args["BLOCK"] // 2})
    tuner = Autotuner(below, below.arg_names, CONFIGS, ["n"], None, None, do_bench=jit.bench)
    x, y = tensors()
    tuner[(1,)](x=x, y=y, n=32, n_cols=1)
    reference = jit.take()[-1]
    TunedLaunch(tuner)[(1,)](x=x, y=y, n=32, n_cols=1)
    assert jit.take() == [reference] and reference["HALF"] == 16


def test_a_single_config_needs_no_key():
    jit = RecordingJIT()
    kernel, tuner = autotuned(jit, configs=[CONFIGS[2]])
    x, y = tensors()
    kernel[(1,)](x=x, y=y, n=5, n_cols=1)
    reference = jit.take()
    TunedLaunch(kernel)[(1,)](x=x, y=y, n=6, n_cols=1)
    assert [r["BLOCK"] for r in reference] == [128] and jit.take()[0]["BLOCK"] == 128 and not tuner.cache


def test_wrappers_it_does_not_mirror_are_gone_through():
    """An autotuner subclass with its own run, and a config with a pre-hook, launch through the wrappers."""
    jit = RecordingJIT()
    runs = []

    class OwnRun(Autotuner):
        def run(self, *args, **kwargs):
            runs.append(kwargs["n"])
            return super().run(*args, **kwargs)
    kernel, _ = autotuned(jit, tuner_class=OwnRun)
    fast = TunedLaunch(kernel)
    x, y = tensors()
    for _ in range(2):
        fast[(1,)](x=x, y=y, n=64, n_cols=1)
    assert not fast.direct and runs == [64, 64]

    hooked = []
    configs = [Config({"BLOCK": 32}, pre_hook=lambda args: hooked.append(args["n"])), CONFIGS[1]]
    kernel, tuner = autotuned(jit, configs=configs, heuristics=False)
    tuner.cache[(16, "torch.float32", "torch.float16")] = configs[0]
    jit.take()
    for _ in range(2):
        TunedLaunch(kernel)[(1,)](x=x, y=y, n=16, n_cols=1)
    assert hooked == [16, 16] and [r["BLOCK"] for r in jit.take()] == [32, 32]


def test_other_triton_series_go_through_the_wrappers(monkeypatch):
    import triton

    from k3.ops import tuned_launch
    assert tuned_launch.triton_mirrored("3.6.0") and tuned_launch.triton_mirrored("3.6.1+git")
    assert not tuned_launch.triton_mirrored("3.7.0") and not tuned_launch.triton_mirrored("3.5.1")
    kernel, _ = autotuned(RecordingJIT())
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    tuned_launch.triton_mirrored.cache_clear()
    try:
        assert not TunedLaunch(kernel).direct
    finally:
        tuned_launch.triton_mirrored.cache_clear()


def test_lean_copy_binds_the_kernels_of_the_copy_only():
    """The copy's kernels (and a peeled callee's) launch through TunedLaunch; the module's function and names
    are untouched; a decorator on the function is peeled."""
    jit = RecordingJIT()
    kernel, tuner = autotuned(jit)
    other_jit = RecordingJIT()
    other, _ = autotuned(other_jit)
    module = types.ModuleType("fake_fla_stage")
    exec("def helper(x, y, n):\n"
         "    other[(2,)](x=x, y=y, n=n, n_cols=2)\n"
         "def stage(x, y, n):\n"
         "    helper(x, y, n)\n"
         "    kernel[(1,)](x=x, y=y, n=n, n_cols=1)\n"
         "    return [r['n'] for r in launches]\n", module.__dict__)
    calls = []

    def decorated(*args):
        calls.append(args)
        return module.stage(*args)
    decorated.__wrapped__ = module.stage
    module.kernel, module.other, module.launches = kernel, other, []

    copy = lean_copy(decorated, {"helper": None})
    assert isinstance(copy.__globals__["kernel"], TunedLaunch)
    assert isinstance(copy.__globals__["helper"].__globals__["other"], TunedLaunch)
    assert module.kernel is kernel and module.stage.__globals__["kernel"] is kernel and module.helper is not copy
    x, y = tensors()
    module.stage(x, y, 64)  # tunes both kernels through the module's own function
    reference = (jit.take()[-1], other_jit.take()[-1])
    copy(x, y, 64)
    assert (jit.take(), other_jit.take()) == ([reference[0]], [reference[1]]) and not calls
    assert copy.__name__ == "stage" and copy.__module__ == module.__name__


# ---- fla's own kernels (fla 0.6 importable): on CUDA, else under the Triton interpreter ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fla_series_ok() -> bool:
    try:
        import fla
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:
        return False
    return kda_fla_lean.lean_supported(fla.__version__)


needs_fla = pytest.mark.skipif(not _fla_series_ok(), reason="fla 0.6 not importable")


@pytest.fixture
def spy(monkeypatch):
    """Every JIT launch (kernel, grid, config values) and every autotuner/heuristics run, recorded; off a GPU,
    autotuning picks each kernel's last candidate (no timer there), so the choice is not simply the first."""
    from fla.modules.norm.l2norm import l2norm_fwd_kernel
    from triton.runtime import interpreter
    launches, wrapper_runs = [], []
    bottom = type(TunedLaunch(l2norm_fwd_kernel).jit)  # JITFunction, or the interpreter's stand-in
    if DEVICE == "cpu" and bottom is not interpreter.InterpretedFunction:
        pytest.skip("fla was imported before TRITON_INTERPRET=1 was set: its kernels cannot run on the CPU")
    real_run = bottom.run

    def run(self, *args, grid, warmup, **kwargs):
        plain = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str)) or v is None}
        shape = grid(kwargs) if callable(grid) else grid  # fla's grids are closures made per call
        launches.append((getattr(self, "__name__", self.fn.__name__), tuple(shape), plain))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(bottom, "run", run)
    for cls in (Autotuner, Heuristics):
        def counted(self, *args, _run=cls.run, **kwargs):
            wrapper_runs.append(self)
            return _run(self, *args, **kwargs)
        monkeypatch.setattr(cls, "run", counted)
    if DEVICE == "cpu":
        monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **k: [float(-self.configs.index(config))] * 3)
    return launches, wrapper_runs


# on CUDA the serving shapes and dtypes (`small`'s 12 heads of 128, bf16; the shipped table pins their choices, so
# nothing is benchmarked); under the interpreter small fp32 ones
SHAPES = dict(K=128, T=130, H=12, dtype=torch.bfloat16) if DEVICE == "cuda" else dict(K=16, T=70, H=2,
                                                                                       dtype=torch.float32)


def stage_calls(st, K, T, H, dtype):
    """The lean stages the interpreter can run, on fixed inputs (the intra-chunk and state stages' kernels index a
    loop bound with a tensor, which the interpreter refuses; the CUDA tests of test_kda_fla_lean cover them)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(DEVICE, dt)  # noqa: E731
    q, v, f, x, gate = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(T * H, K), r(T * H, K)
    A_log, dt_bias = r(H, dt=torch.float32) * 0.1, r(H * K, dt=torch.float32) * 0.1
    gk = st["gate_cumsum"](g=f, A_log=A_log, dt_bias=dt_bias, scale=st["rcp_ln2"], chunk_size=64, cu_seqlens=None,
                           chunk_indices=None, lower_bound=-5.0)
    h, A = r(1, -(-T // 64), H, K, K) * 0.1, torch.tril(r(1, T, H, 64) * 0.1)
    return dict(l2norm=st["l2norm"](q)[0], gate=gk,
                output=st["output"](q=q, v=v, g=gk, A=A, h=h, scale=K ** -0.5, chunk_size=64),
                norm=st["gated_norm"](x, gate, torch.ones(K, device=DEVICE), None, activation="sigmoid", eps=1e-6,
                                      is_rms_norm=True)[0])


@needs_fla
def test_lean_stages_launch_fla_kernels_with_the_autotuners_choice(spy, monkeypatch):
    launches, wrapper_runs = spy
    if DEVICE == "cuda":
        from k3.ops import tuning
        tuning.pin_for_device(torch.device("cuda"))
    monkeypatch.setattr(kda_fla_lean, "TUNED_LAUNCHES", False)
    with torch.inference_mode():
        stage_calls(kda_fla_lean._stages(), **SHAPES)  # tunes every key through the wrappers
        launches.clear()
        through = stage_calls(kda_fla_lean._stages(), **SHAPES)
        reference = list(launches)
        assert wrapper_runs and len(reference) == 4  # gate, L2 norm, output, gated norm
        launches.clear()
        wrapper_runs.clear()
        monkeypatch.setattr(kda_fla_lean, "TUNED_LAUNCHES", True)
        tuned = stage_calls(kda_fla_lean._stages(), **SHAPES)
    assert launches == reference  # the same kernels, grids and config values, in the same order
    assert not wrapper_runs  # every key was held: no wrapper ran
    for name, value in through.items():
        assert torch.equal(tuned[name], value), name
    if DEVICE == "cpu":  # (on a GPU a new key would benchmark every candidate: the recording tests cover it)
        with torch.inference_mode():
            stage_calls(kda_fla_lean._stages(), **dict(SHAPES, K=32))  # a new head size: new keys, tuned
        assert wrapper_runs


@needs_fla
def test_lean_stages_leave_fla_modules_and_public_entries_alone():
    import fla.modules.norm.l2norm as l2norm_module
    import fla.ops.kda.chunk_intra as intra_module
    import fla.ops.kda.wy_fast as wy_module
    before = {m: dict(vars(m)) for m in (l2norm_module, intra_module, wy_module)}
    st = kda_fla_lean._stage_set(True)
    for module, names in before.items():
        assert all(vars(module)[k] is v for k, v in names.items()), module.__name__
    bound = {name for name, v in st["intra"].__globals__.items() if isinstance(v, TunedLaunch)}
    assert bound == {"chunk_kda_fwd_kernel_intra_sub_chunk", "chunk_kda_fwd_kernel_inter_solve_fused"}
    w_u = st["intra"].__globals__["recompute_w_u_fwd"]
    assert w_u is not wy_module.recompute_w_u_fwd
    assert isinstance(w_u.__globals__["recompute_w_u_fwd_kda_kernel"], TunedLaunch)
    assert {n for n, v in st["l2norm"].__globals__.items() if isinstance(v, TunedLaunch)} == {
        "l2norm_fwd_kernel", "l2norm_fwd_kernel_row"}
    assert not isinstance(st["beta_sigmoid"].__globals__["fused_beta_sigmoid_fwd_kernel"], TunedLaunch)  # no wrapper


@needs_fla
def test_fla_cache_mode_always_goes_through_fla_s_autotuner(monkeypatch):
    """FLA_CACHE_MODE=always re-reads fla's config files on every call: its kernels keep their wrappers."""
    from fla.ops.utils import cache
    jit = RecordingJIT()
    kernel, _ = autotuned(jit, tuner_class=cache.CachedAutotuner)
    assert TunedLaunch(kernel).direct
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.ALWAYS)
    assert not TunedLaunch(kernel).direct
