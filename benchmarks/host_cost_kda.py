"""Host cost of an eager serving step's KDA layers, with the device work taken away: what the launch side costs.

Every Triton launch is replaced by a recorder (Triton's interpreter is the driver, so this runs on any CPU with
triton and fla installed), so what is left is the Python and dispatch work that an eager GPU step does before its
kernels run. Per call it counts, with every tensor on torch's `meta` device (shapes, no data, no kernels): Triton
launches (by kernel), torch ops that launch a kernel on a GPU (views and empty allocations excluded) and
host-to-device copies; and it times the host on small CPU tensors (best and median step of `--repeat` rounds that
take one step of each entry in turn: this CPU is shared; the host work does not depend on the sizes). Each "step"
is 12 KDA layers sharing one layout, as `small` serving a 2,048-token prefill (`--tokens`, `--seqs`, `--layers`,
`--heads`, `--head-dim`). With `--cuda` (and TRITON_INTERPRET=0) nothing is stubbed: the steps launch for real on
a GPU with `--time-tokens` tokens and the model's heads (host-bound; the shipped autotune table's keys), timed to
a synchronise, uncounted.

    PYTHONPATH=src:/tmp/flaw python benchmarks/host_cost_kda.py   # fla on the path; triton installed
    ... host_cost_kda.py --only "chunk_kda lean,norm lean" --repeat 40   # just the entries naming a word
    python benchmarks/host_cost_kda.py --serve-step   # the serving layout's gathers per eager step (tiny, CPU)

Entries: fla's public `chunk_kda` as k3 calls it (`fla_kda_gated`), the lean entry (`K3_FLA_LEAN=1`:
k3.ops.kda_fla_lean) with its kernels launched through fla's and Triton's autotuner wrappers (the eleventh
session's) and past them (k3.ops.tuned_launch), KDA's gated output norm the same three ways, and two of k3's own
launchers (RMSNorm, SiTU-GLU) through their autograd.Function and as inference launches them (straight, no
Function). A read of a device value raises on `meta`: a path that reads one back fails here instead of waiting on a
GPU.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # a driver without a GPU; every launch is stubbed below
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="k3-host-cost-"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NOT_KERNELS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
               "detach", "detach_", "alias", "_reshape_alias", "set_"}  # allocations and metadata: no kernel on a GPU


class Recorder(TorchDispatchMode):
    """Counts torch ops that would launch a GPU kernel, and copies from the host onto the device."""

    def __init__(self, launches: collections.Counter):
        super().__init__()
        self.ops, self.launches, self.h2d = collections.Counter(), launches, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if args and name not in ("copy_",) and _alias(out, args[0]):
            return out  # a view, or `to`/`contiguous`/`type_as` with nothing to do: no kernel
        if name in ("to", "_to_copy", "copy_"):  # under inference mode `to` arrives undecomposed
            src = args[1] if name == "copy_" else args[0]
            dst = args[0] if name == "copy_" else out
            if src.device.type == "cpu" and dst.device.type == "meta":
                self.h2d += 1
                return out
        # ops on host tensors (a chunk plan built on the host) launch nothing
        if not func.is_view and name not in NOT_KERNELS and _on_device(args, out):
            self.ops[name] += 1
        return out


def _alias(out, x) -> bool:
    return (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and out.untyped_storage()._cdata == x.untyped_storage()._cdata)


def _on_device(args, out) -> bool:
    """Whether an op touches the device (meta here): ops on host tensors are host work."""
    flat = list(args) + (list(out) if isinstance(out, (tuple, list)) else [out])
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat)


def stub_triton(launches: collections.Counter) -> None:
    """Every Triton launch only counts; every autotuner takes its first candidate without running it."""
    from triton.runtime import autotuner, interpreter

    def run(self, *args, grid, warmup, **kwargs):
        launches[self.__name__] += 1

    interpreter.InterpretedFunction.run = run
    autotuner.Autotuner._bench = lambda self, *a, config, **k: [float(self.configs.index(config))] * 3


def make_inputs(args, device, tokens, heads=None, head_dim=None, dtype=torch.bfloat16):
    N, H, K = tokens, heads or args.heads, head_dim or args.head_dim
    lens = [N // args.seqs] * args.seqs
    lens[-1] += N - sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    feats = [torch.empty(1, N, H, K, device=device, dtype=dtype) for _ in range(4)]  # q, k, v, f
    beta = torch.empty(1, N, H, device=device, dtype=dtype)
    A_log = torch.empty(H, device=device)
    dt_bias = torch.empty(H * K, device=device)
    state = torch.empty(args.seqs, H, K, K, device=device)
    return feats, beta, A_log, dt_bias, state, cu


def make_step(layer_call, args, device, tokens, *dims):
    """One step: `args.layers` calls sharing one layout (fresh cu_seqlens tensors per step, as the engine makes)."""
    feats, beta, A_log, dt_bias, state, cu = make_inputs(args, device, tokens, *dims)

    def step():
        dev, host = torch.tensor(cu, device=device), torch.tensor(cu)
        for _ in range(args.layers):
            layer_call(feats, beta, A_log, dt_bias, state, dev, host)
    return step


def measure(entries, args, launches) -> list[dict]:
    """Each entry counted on `meta` at the given sizes, then timed on CPU tensors of `--time-tokens` tokens, 2 heads
    of 32 (meta's shape functions are Python, far slower than a GPU's dispatch; the host work does not depend on
    the sizes, and the CPU's fills of a few KB cost little). The timed steps go round the entries, one step each
    per round, so that load from other work on a shared CPU falls on all of them alike."""
    rows, timed = [], []
    L, cuda = args.layers, args.cuda
    with torch.inference_mode():
        for name, layer_call in entries:
            if cuda:  # real launches: timed only (a step's wall time, synchronised; the device work is tiny)
                rows.append(dict(name=name, triton=float("nan"), torch=float("nan"), h2d_per_step="-",
                                 kernels={}, ops={}, times=[]))
                timed.append(make_step(layer_call, args, "cuda", args.time_tokens))  # the model's heads: pinned keys
                for _ in range(3):
                    timed[-1]()  # the first calls autotune
                torch.cuda.synchronize()
                continue
            step = make_step(layer_call, args, "meta", args.tokens)
            for _ in range(2):
                step()  # warm-up: first-call work (imports, autotuner choices)
            launches.clear()
            rec = Recorder(launches)
            with rec:
                step()
            counted = collections.Counter(launches)
            rows.append(dict(name=name, triton=sum(counted.values()) / L, torch=sum(rec.ops.values()) / L,
                             h2d_per_step=rec.h2d, kernels={k: v / L for k, v in sorted(counted.items())},
                             ops={k: v / L for k, v in sorted(rec.ops.items())}, times=[]))
            timed.append(make_step(layer_call, args, "cpu", args.time_tokens, 2, 32))
            for _ in range(2):
                timed[-1]()
        for _ in range(args.repeat):
            for row, step in zip(rows, timed):
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                row["times"].append(time.perf_counter() - t0)
    for row in rows:  # the best step: the least disturbed by other load; the median for the spread
        times = sorted(row.pop("times"))
        row["us_per_layer"], row["median_us"] = times[0] / L * 1e6, times[len(times) // 2] / L * 1e6
    return rows


def serve_step_ops(args) -> int:
    """`--serve-step`: ops per eager engine step with prompt chunks (`tiny` on the CPU, torch.profiler's counts):
    the serving layout's gathers and scatters, which need neither triton nor fla."""
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).eval()
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=1 << 28, block_size=64, match_unit=16,
                                              max_batch_tokens=256, max_num_seqs=16, num_state_slots=64,
                                              decode_graphs=True))
    prompts = torch.randint(64, cfg.vocab_size, (32, 64), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    counts, eager = [], eng.runner._run_eager

    def counted(seqs, lens, *a, **k):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = eager(seqs, lens, *a, **k)
        if any(n > 1 for n in lens):
            counts.append(collections.Counter(e.name for e in prof.events()))
        return out
    eng.runner._run_eager = counted
    with torch.inference_mode():
        todo, live = list(prompts), 0
        while todo or eng.has_unfinished():
            while todo and live < 16:
                eng.add_request(todo.pop(0), params)
                live += 1
            live -= sum(o.finished for o in eng.step())
    ops = ("aten::index", "aten::index_put_", "aten::cat", "aten::copy_", "aten::silu", "aten::silu_")
    print(f"tiny, 16 streams of 64-token prompts, 256-token steps: {len(counts)} eager steps with prompt chunks; "
          "median per step:")
    for op in ops:
        print(f"  {op}: {sorted(c[op] for c in counts)[len(counts) // 2]}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--time-tokens", type=int, default=128, help="tokens of the timed CPU steps")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--detail", action="store_true", help="list the launches and torch ops of each entry")
    p.add_argument("--cuda", action="store_true", help="instead of stubbing Triton: time real launches on the GPU "
                   "(set TRITON_INTERPRET=0), uncounted")
    p.add_argument("--only", default="", help="comma-separated words: measure only the entries naming one")
    p.add_argument("--serve-step", action="store_true", help="instead: the serving layout's ops per eager step "
                   "(tiny on the CPU; needs neither triton nor fla)")
    args = p.parse_args(argv)
    if args.serve_step:
        return serve_step_ops(args)
    try:
        import fla  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        print(f"host_cost_kda: needs triton and fla importable ({e})", file=sys.stderr)
        return 2
    from k3 import envs
    from k3.ops import kda_fla

    launches = collections.Counter()
    if not args.cuda:
        stub_triton(launches)

    from k3.ops import kda_fla_lean

    def kda(lean, tuned_launches=True):
        def call(feats, beta, A_log, dt_bias, state, dev, host):
            q, k, v, f = feats
            kda_fla_lean.TUNED_LAUNCHES = tuned_launches  # False: the eleventh session's lean path
            with envs.override(fla_lean=lean):
                return kda_fla.fla_kda_gated(q, k, v, f, beta, A_log, dt_bias, -5.0, initial_state=state,
                                             output_final_state=True, cu_seqlens=dev, cu_seqlens_cpu=host,
                                             recurrent=False)
        return call

    def norm(lean, tuned_launches=True):
        def call(feats, beta, A_log, dt_bias, state, dev, host):
            kda_fla_lean.TUNED_LAUNCHES = tuned_launches
            with envs.override(fla_lean=lean):
                return kda_fla.fla_output_gate(feats[2], feats[3], A_log.new_empty(feats[2].shape[-1]), 1e-6)
        return call

    from k3.ops import _norm_triton, fused_situ

    def k3_norm(through_function):
        def call(feats, beta, A_log, dt_bias, state, dev, host):
            w = A_log.new_empty(feats[0].shape[-1])
            if through_function:
                return _norm_triton._TritonNorm.apply(feats[0], w, 1e-6, True)
            return _norm_triton.rms_norm(feats[0], w, 1e-6)
        return call

    def k3_situ(through_function):
        def call(feats, beta, A_log, dt_bias, state, dev, host):
            if through_function:
                return fused_situ._FusedSiTUGLU.apply(feats[0], feats[1], 4.0, 25.0)
            return fused_situ.fused_situ_glu(feats[0], feats[1])
        return call

    entries = [("chunk_kda (fla's public entry)", kda(False)),
               ("chunk_kda lean, through the autotuner wrappers", kda(True, tuned_launches=False)),
               ("chunk_kda lean (K3_FLA_LEAN=1), tuned launches", kda(True)),
               ("gated output norm (fla's public)", norm(False)),
               ("gated output norm lean, through the autotuner wrappers", norm(True, tuned_launches=False)),
               ("gated output norm lean, tuned launches", norm(True)),
               ("k3 RMSNorm through its autograd.Function", k3_norm(True)),
               ("k3 RMSNorm, inference launch", k3_norm(False)),
               ("k3 SiTU-GLU through its autograd.Function", k3_situ(True)),
               ("k3 SiTU-GLU, inference launch", k3_situ(False))]
    rows = measure([(name, call) for name, call in entries
                    if not args.only or any(word in name for word in args.only.split(","))], args, launches)
    print(f"{args.layers} KDA layers a step, {args.tokens} tokens in {args.seqs} sequences, H={args.heads}, "
          f"K={args.head_dim}; "
          + (f"timed on the GPU at {args.time_tokens} tokens, real launches, synchronised steps"
             if args.cuda else "counted on meta, timed on small CPU tensors, Triton launches stubbed")
          + f"; torch {torch.__version__}")
    print("| entry | host us / call (best) | (median) | Triton launches / call | torch kernels / call "
          "| host->device copies / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['us_per_layer']:.0f} | {r['median_us']:.0f} | {r['triton']:g} | {r['torch']:g} "
              f"| {r['h2d_per_step']} |")
    if args.detail:
        for r in rows:
            print(f"\n{r['name']}:\n  Triton: {r['kernels']}\n  torch:  {r['ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
