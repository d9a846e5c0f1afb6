"""Where a continuous batch loses to a static one: the engine's step timeline at N streams, without HTTP.

Not a benchmark with a peer table of its own (that is `k3 bench serve`); it answers why the engine's tokens/s
trail the static graphed batch. It drives an LLMEngine directly the way `k3 bench serve --concurrency N` does
(N requests in flight, a new one added as one finishes; random prompts, EOS ignored, greedy), after one untimed
wave, and then times the model's own `generate` over static batches of N on the same prompts' shape.
Per engine step it records the kind (prefill only, mixed prefill+decode, decode from a graph, decode eager),
rows, tokens, the block-table columns a graph's attention reads against the blocks the rows hold, and the host
time of each phase: schedule, runner.run (launching; a graph replay is one call), sample_tokens (which holds
the one read of the sampled ids, so it includes waiting for the device) and the rest. With --profile, a second, shorter pass
under torch.profiler gives the device's busy time per step kind (kernels' summed time) and its kernel count.
With --sync-trace, a short pass per variant counts where each step makes the host wait for the device (CUDA's
sync debug mode: reads of device values, copies from pageable memory, stream syncs), by file and line.
With --cprofile, a short pass under cProfile lists the prompt-chunk steps' Python time by function.
With --census, a short pass per variant counts the torch ops each step launches (ops that launch a kernel on a GPU:
views and allocations left out), by where: the engine around the forward (scheduling, the pool's slot copies and
zeroing, sampling), the runner's own (the step's layout, logits), the model's (KDA's cores counted apart, as calls:
fla's on a GPU, the torch reference on a CPU) and the serving layouts' state reads and writes inside it. Counts,
not times: on any device, and `--preset small-pattern` (small's 16 layers, 12 KDA + 4 MLA, 64 experts top-8, at
tiny widths) makes a CPU pass fast; a count does not depend on widths. Its last row is the model's own batched
forward (no cache) of a full step's tokens, and per step kind it lists the ops launched beyond that forward's
(what serving adds); `--dtype bfloat16` on a CPU counts the casts the GPU's dtype makes.
Run: PYTHONPATH=src python benchmarks/profile_serve.py [--preset small --device cuda --streams 64]
    [--variants ';split_mixed_steps=true'] [--rounds 2] [--profile] [--sync-trace] [--cprofile] [--census]
A variant may also set k3.envs switches, e.g. `--variants 'fla_lean=false;fla_lean=true'` (fla's public chunk_kda
against k3.ops.kda_fla_lean).
"""
import argparse
import bisect
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import save, table, with_stacks  # noqa: E402
from op_census import launches_kernel  # noqa: E402

import k3.serve.engine as engine_mod  # noqa: E402
from k3 import envs  # noqa: E402
from k3.config import K3Config, _scaled  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402

# the engine's own sampler halves (queue the picks; read them back), before a recorder wraps them
SAMPLERS = {name: getattr(engine_mod, name) for name in ("launch_sampling", "finish_sampling")}


class StepRecorder:
    """Wraps the engine's phases (schedule, runner.run, sampling) with host timers; one record per step. With
    async_output, a step planned while the previous one is in flight is a "decode ... async" step, and its
    sample_ms also holds the read-back of the step it finishes."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.steps, self.cur = engine, [], None
        sched, run = engine.scheduler.schedule, engine.runner.run
        sched_in_flight = engine.scheduler.schedule_in_flight
        graphs = engine.runner.graphs

        def timed_schedule(*in_flight):
            t = time.perf_counter()
            plan = sched_in_flight(*in_flight) if in_flight else sched()
            if plan is None:
                return None
            seqs, lens = plan
            prefill = sum(1 for s in seqs if s.in_prefill)
            fits = graphs is not None and graphs.fits(seqs, lens)
            kind = "prefill" if prefill == len(seqs) else ("mixed" if prefill else
                                                           ("decode graph" if fits else "decode eager"))
            kind += " async" if in_flight else ""
            real = sum(len(s.block_table) for s in seqs) if seqs else 0
            if seqs and fits:
                rows = 1 << (len(seqs) - 1).bit_length()
                read = rows * (1 << (max(len(s.block_table) for s in seqs) - 1).bit_length())
            else:
                read = len(seqs) * max((len(s.block_table) for s in seqs), default=0)
            self.cur = dict(t0=t, kind=kind, rows=len(seqs), tokens=sum(lens), blocks_real=real, blocks_read=read,
                            sched_ms=(time.perf_counter() - t) * 1e3, run_ms=0.0, sample_ms=0.0)
            return seqs, lens

        def timed_run(*a, **k):
            t = time.perf_counter()
            out = run(*a, **k)
            self.cur["run_ms"] = (time.perf_counter() - t) * 1e3
            return out

        engine.scheduler.schedule, engine.runner.run = timed_schedule, timed_run
        engine.scheduler.schedule_in_flight = timed_schedule
        for name, fn in SAMPLERS.items():
            setattr(engine_mod, name, self._summed(fn, "sample_ms"))
        # the engine's bookkeeping between the forward and the sampler, and its per-token output work
        for obj, name, key in ((engine.pool, "register_computed", "book_ms"), (engine, "_maybe_checkpoint", "book_ms"),
                               (engine.pool, "flush_checkpoint_copies", "book_ms"), (engine, "_append_token", "append_ms")):
            setattr(obj, name, self._summed(getattr(obj, name), key))

    def _summed(self, fn, key):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if self.cur is not None:
                self.cur[key] = self.cur.get(key, 0.0) + (time.perf_counter() - t) * 1e3
            return out
        return wrapped

    def step(self):
        outs = self.engine.step()
        if self.cur is not None and self.cur["rows"]:
            c = self.cur
            c["wall_ms"] = (time.perf_counter() - c.pop("t0")) * 1e3
            c.setdefault("book_ms", 0.0)
            c.setdefault("sample_ms", 0.0)
            c.setdefault("append_ms", 0.0)
            c["other_ms"] = c["wall_ms"] - c["sched_ms"] - c["run_ms"] - c["sample_ms"] - c["book_ms"] - c["append_ms"]
            self.steps.append(c)
        self.cur = None
        return outs


def drive(rec, prompts, params, streams, on_step=None) -> tuple[float, int]:
    """Keep `streams` requests in flight until every prompt is done → (wall s, output tokens)."""
    eng, todo, live, n_out = rec.engine, list(prompts), 0, 0
    t0 = time.perf_counter()
    while todo or eng.has_unfinished():
        while todo and live < streams:
            eng.add_request(todo.pop(0), params)
            live += 1
        if on_step is not None:
            on_step()
        for out in rec.step():
            n_out += len(out.new_token_ids)
            live -= out.finished
    return time.perf_counter() - t0, n_out


def summarize_steps(steps: list[dict]) -> list[dict]:
    rows = []
    by = collections.defaultdict(list)
    for s in steps:
        by[s["kind"]].append(s)
    for kind, ss in sorted(by.items()):
        med = lambda key: statistics.median(x[key] for x in ss)  # noqa: E731
        rows.append(dict(kind=kind, steps=len(ss), total_ms=sum(x["wall_ms"] for x in ss), wall_ms=med("wall_ms"),
                         sched_ms=med("sched_ms"), run_ms=med("run_ms"), sample_ms=med("sample_ms"),
                         book_ms=med("book_ms"), append_ms=med("append_ms"), other_ms=med("other_ms"), rows=med("rows"), tokens=med("tokens"),
                         blocks_read_over_real=sum(x["blocks_read"] for x in ss) / max(1, sum(x["blocks_real"] for x in ss))))
    return rows


# runtime calls that make the host wait for the device (a blocking copy waits too: cudaMemcpy without Async)
HOST_WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def is_prompt_chunk(kind: str) -> bool:
    return "mixed" in kind or "prefill" in kind


def kernel_events(evs):
    """The device-side events that are kernels or copies, not the GPU-side ranges of user annotations: a
    `record_function` label (k3_step, any other range) also shows as a CUDA event, under the same name as its CPU
    range, and summing it counts the whole step as kernel time. So a CUDA event whose name is also a CPU event's
    name is a range, not work."""
    cuda = torch.autograd.DeviceType.CUDA
    host_names = {e.name for e in evs if e.device_type != cuda}
    return [e for e in evs if e.device_type == cuda and e.name not in host_names]


def step_of(t, starts):
    """Index of the step span whose start is the last at or before t (-1: before the first)."""
    return bisect.bisect_right(starts, t) - 1


def calling_line(e) -> str:
    """The innermost k3 frame that led to op e: from its recorded stack, or (where torch records Python frames as
    events of their own, leaving the stack empty) from the chain of its parent events."""
    def ours(f):
        return "/k3/" in f or "benchmarks/" in f or f.startswith("k3/")
    hit = next((f for f in (e.stack or []) if ours(f)), None)
    p = e.cpu_parent
    while hit is None and p is not None:
        if ".py(" in p.name and ours(p.name):
            hit = p.name
        p = p.cpu_parent
    return hit or "?"


def host_table(evs, spans, marks, rows=14):
    """Prompt-chunk steps only: self CPU time per step by the Python line that called (the innermost k3 frame of
    the op's stack), and the host's waits for the device per step by line. An event belongs to the step whose host
    span contains its start."""
    starts = [a for a, _ in spans]
    chunk = [i for i, k in enumerate(marks) if is_prompt_chunk(k)]
    n = max(1, len(chunk))
    chunk = set(chunk)
    self_us, waits = collections.Counter(), collections.Counter()
    calls = collections.Counter()
    for e in evs:
        if e.device_type == torch.autograd.DeviceType.CUDA or e.name == "k3_step":
            continue
        j = step_of(e.time_range.start, starts)
        if j < 0 or j not in chunk or e.time_range.start > spans[j][1]:
            continue
        if ".py(" in e.name or e.name.startswith("<built-in"):
            continue  # a Python frame (torch records them as events of their own), not an op
        line = calling_line(e)
        key = f"{e.name[:40]} @ {line[-70:]}"
        self_us[key] += e.self_cpu_time_total
        calls[key] += 1
        if e.name in HOST_WAIT_CALLS:
            waits[key] += 1
    print(f"\n== prompt-chunk steps ({n}): self CPU us per step by op and calling line", flush=True)
    for key, us in self_us.most_common(rows):
        print(f"  {us / n:9.0f} us  {calls[key] / n:7.1f} calls  {key}")
    print(f"== prompt-chunk steps: host waits for the device per step ({sum(waits.values()) / n:.1f}) by line",
          flush=True)
    for key, c in waits.most_common(rows):
        print(f"  {c / n:7.1f}  {key}")
    return [dict(site=k, us_per_step=self_us[k] / n, calls_per_step=calls[k] / n) for k, _ in
            self_us.most_common(rows)]


def kernel_launchers(evs, spans, marks, kernels, top=2) -> None:
    """For each kernel named, the ops that launched it in prompt-chunk steps (their input shapes and the k3 line
    that called them), by device time: which call a cuBLAS or elementwise kernel of the top list comes from."""
    starts = [a for a, _ in spans]
    by = collections.defaultdict(collections.Counter)
    for e in evs:
        if e.device_type == torch.autograd.DeviceType.CUDA or not e.kernels:
            continue
        j = step_of(e.time_range.start, starts)
        if j < 0 or j >= len(marks) or not is_prompt_chunk(marks[j]):
            continue
        for k in e.kernels:
            if k.name in kernels:
                by[k.name][f"{e.name} {e.input_shapes} @ {calling_line(e)[-60:]}"] += k.duration
    print("== prompt-chunk steps: who launched the top kernels (device us over the pass)", flush=True)
    for name in dict.fromkeys(kernels):
        for who, us in by[name].most_common(top):
            print(f"  {name[:50]:50s} {us:9.0f} us  {who[:200]}")


def device_profile(rec, prompts, params, streams) -> list[dict]:
    """Kernels per step kind under torch.profiler: summed kernel time, count, and the step's wall; and the host
    table of prompt-chunk steps (see host_table). On a CPU the kernel columns are empty; the host table holds."""
    from torch.profiler import ProfilerActivity, profile, record_function
    marks = []
    inner = rec.step

    def marked_step():
        with record_function("k3_step"):
            outs = inner()
        if rec.steps:
            marks.append(rec.steps[-1]["kind"])
        return outs
    rec.step = marked_step
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True, **with_stacks()) as prof:
        drive(rec, prompts, params, streams)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rec.step = inner
    # which lines hold the host: the ops and runtime calls with the most self CPU time, by their Python caller
    print(prof.key_averages(group_by_stack_n=3).table(sort_by="self_cpu_time_total", row_limit=14,
                                                      max_name_column_width=36, max_src_column_width=90), flush=True)
    evs = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in evs
                   if e.name == "k3_step" and e.device_type != torch.autograd.DeviceType.CUDA)
    marks = marks[:len(spans)]
    host_table(evs, spans, marks)
    kernels = sorted((e.time_range.start, e.device_time, e.name) for e in kernel_events(evs))
    # a kernel belongs to the step whose host span launched it: its device start falls after that step's start
    starts = [a for a, _ in spans]
    per = [[0.0, 0] for _ in spans]
    named = collections.defaultdict(collections.Counter)  # step kind -> kernel name -> summed device us
    for t, d, name in kernels:
        j = step_of(t, starts)
        if j >= 0:
            per[j][0] += d
            per[j][1] += 1
            if j < len(marks):
                named[marks[j]][name] += d
    # what a prompt-chunk step's device time is made of (per step, us): the kernels to cut or replace
    for kind, c in sorted(named.items()):
        if is_prompt_chunk(kind):
            n = marks.count(kind)
            print(f"== {kind}: top kernels, device us per step: " + "; ".join(
                f"{name[:60]} {us / n:.0f}" for name, us in c.most_common(15)), flush=True)
    kernel_launchers(evs, spans, marks, [name for c in named.values() for name, _ in c.most_common(8)])
    by = collections.defaultdict(list)
    for (a, b), (busy, n), kind in zip(spans, per, marks):
        by[kind].append(((b - a) / 1e3, busy / 1e3, n))
    return [dict(kind=k, steps=len(v), wall_ms=statistics.median(x[0] for x in v),
                 kernel_ms=statistics.median(x[1] for x in v), kernels=statistics.median(x[2] for x in v),
                 idle_share=1 - sum(x[1] for x in v) / sum(x[0] for x in v)) for k, v in sorted(by.items())]


@contextlib.contextmanager
def device_waits():
    """Where the block makes the host wait for the device, as "file:line" of the Python line that asked (filled in
    when the block ends). CUDA's sync debug mode warns at each synchronizing call: a read of device values
    (.item(), .tolist(), a bool of a tensor), a copy to or from pageable memory, a stream or device sync. It does
    not warn at `torch.cuda.Event.synchronize` (cudaEventSynchronize: the wait of a read queued into pinned
    memory, k3.serve.sampling.read_back's), so those calls are recorded here, where they are made; one on an event
    that had already completed (no wait, though a synchronizing call) is marked " (complete)"."""
    sites, event_sites = [], []
    event_sync = torch.cuda.Event.synchronize

    def recorded_event_sync(event):
        caller = sys._getframe(1)
        mark = " (complete)" if event.query() else ""
        event_sites.append((caller.f_code.co_filename, f"{caller.f_lineno}{mark}"))
        return event_sync(event)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = recorded_event_sync
        try:
            yield sites
        finally:
            torch.cuda.Event.synchronize = event_sync
            torch.cuda.set_sync_debug_mode("default")
    waits = [(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)] + event_sites
    for filename, lineno in waits:
        path = filename.replace("\\", "/")
        for root in ("/site-packages/", "/dist-packages/", "/src/"):
            path = path.split(root)[-1]
        sites.append(f"{path}:{lineno}")


def per_step_kind(rec, prompts, params, streams, measure) -> dict[str, list]:
    """A pass with each engine step inside `measure()` (a context manager): what it yields, filled in by the
    step, listed by the step's kind."""
    inner, per_kind = rec.step, collections.defaultdict(list)

    def measured_step():
        with measure() as seen:
            outs = inner()
        if rec.steps:
            per_kind[rec.steps[-1]["kind"]].append(seen)
        return outs
    rec.step = measured_step
    try:
        drive(rec, prompts, params, streams)
    finally:
        rec.step = inner
    return per_kind


def short_path(filename: str) -> str:
    """A frame's file from its package on (k3/serve/runner.py, fla/ops/..., torch/...)."""
    for mark in ("/k3/", "/site-packages/", "/benchmarks/"):
        if mark in filename:
            return filename.split(mark, 1)[1] if mark == "/site-packages/" else mark[1:] + filename.split(mark, 1)[1]
    return filename


def python_profile(rec, prompts, params, streams, rows=30) -> list[dict]:
    """The prompt-chunk steps' Python time by function (cProfile, one profile a step, those of mixed and prefill
    steps summed): where the host's time goes between launches, which torch.profiler's with_stack cannot name on
    every torch. Per step: the functions with the most own time (tottime), then k3's with the most time inside
(cumtime: which of k3's layers and helpers hold the host), by file:line(function)."""
    import cProfile
    import pstats

    @contextlib.contextmanager
    def profiled():
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield prof
        finally:
            prof.disable()
    per_kind = per_step_kind(rec, prompts, params, streams, profiled)
    chunk = [p for kind, ps in per_kind.items() if is_prompt_chunk(kind) for p in ps]
    if not chunk:
        return []
    stats = pstats.Stats(chunk[0])
    for p in chunk[1:]:
        stats.add(p)
    n = len(chunk)
    items = stats.stats.items()
    own = sorted(items, key=lambda kv: -kv[1][2])[:rows]
    ours = sorted(((k, v) for k, v in items if short_path(k[0]).startswith("k3/")), key=lambda kv: -kv[1][3])[:rows]
    return [dict(order=order, function=f"{short_path(file)}:{line}({fn})"[-90:], own_us=tot / n * 1e6,
                 cum_us=cum / n * 1e6, calls=calls / n)
            for order, part in (("own", own), ("k3 cum", ours)) for (file, line, fn), (_, calls, tot, cum, _) in part]


def sync_trace(rec, prompts, params, streams) -> list[dict]:
    """Host waits per step kind over a short pass: steps, waits per step (median, max) and the commonest sites."""
    per_kind = per_step_kind(rec, prompts, params, streams, device_waits)
    rows = []
    for kind, steps in sorted(per_kind.items()):
        top = collections.Counter(s for sites in steps for s in sites).most_common(6)
        rows.append(dict(kind=kind, steps=len(steps), waits_median=statistics.median(len(x) for x in steps),
                         waits_max=max(len(x) for x in steps),
                         sites=", ".join(f"{site} x{n / len(steps):.2g}" for site, n in top)))
    return rows


class OpCensus(TorchDispatchMode):
    """Kernel-launching torch ops by label; `where` is set by the wrappers `census` installs."""

    def __init__(self):
        super().__init__()
        self.counts, self.where = collections.Counter(), "engine"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if launches_kernel(func, args, out):
            self.counts[self.where] += 1
            self.counts[(self.where, name)] += 1  # by op too: what a where's count is made of
        return out


def census(rec, prompts, params, streams) -> list[dict]:
    """Ops per step kind (means) by where they launch: engine (outside runner.run), runner (inside it, outside
    the model), model (KDA cores apart), layouts (the serving view's KDA state reads and writes, inside the
    model), and the KDA core calls."""
    import k3.model.kda as kda_model
    eng, tally = rec.engine, OpCensus()
    patched = []

    def label(obj, name, where, count=None):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            before, tally.where = tally.where, where
            if count is not None:
                tally.counts[count] += 1
            try:
                return fn(*a, **k)
            finally:
                tally.where = before
        patched.append((obj, name, fn))
        setattr(obj, name, wrapped)

    label(eng.runner, "run", "runner")
    label(eng.model.model, "forward", "model")
    label(kda_model, "kda_core", "kda core", count="kda core calls")
    import k3.serve.runner as runner_mod
    for cls in (runner_mod.PagedBatchView, runner_mod.DecodeGraphView):
        for name in ("kda_state", "set_kda_state"):
            label(cls, name, "layouts")

    @contextlib.contextmanager
    def counted():
        tally.counts.clear()
        seen = collections.Counter()
        with tally:
            yield seen
        seen.update(tally.counts)
    try:
        per_kind = per_step_kind(rec, prompts, params, streams, counted)
    finally:
        for obj, name, fn in reversed(patched):
            setattr(obj, name, fn)
    mean = lambda xs, key: sum(x[key] for x in xs) / len(xs)  # noqa: E731  (a step's rare work counts too)
    rows = []
    for kind, xs in sorted(per_kind.items()):
        ops = collections.Counter()
        for x in xs:
            ops.update({k: v for k, v in x.items() if isinstance(k, tuple)})
        rows.append(dict(kind=kind, steps=len(xs), engine=mean(xs, "engine"), runner=mean(xs, "runner"),
                         model=mean(xs, "model"), layouts=mean(xs, "layouts"),
                         kda_core_calls=mean(xs, "kda core calls"),
                         ops={f"{w}/{op}": n / len(xs) for (w, op), n in ops.most_common()}))
    return rows


def forward_census(model, tokens: int, rows: int, vocab: int) -> dict:
    """The model's own batched forward (no cache) over `tokens` tokens as `rows` rows: the ops it launches, as
    `census` counts a step's (KDA cores as calls), so a serving step's extra ops show against it."""
    import k3.model.kda as kda_model
    tally, core, calls = OpCensus(), kda_model.kda_core, [0]

    def counted_core(*a, **k):
        before, tally.where = tally.where, "kda core"
        calls[0] += 1
        try:
            return core(*a, **k)
        finally:
            tally.where = before
    kda_model.kda_core = counted_core
    ids = torch.randint(64, vocab, (rows, tokens // rows), device=next(model.parameters()).device)
    try:
        with torch.inference_mode(), tally:
            tally.where = "model"
            model(ids)
    finally:
        kda_model.kda_core = core
    ops = collections.Counter({k: v for k, v in tally.counts.items() if isinstance(k, tuple)})
    return dict(kind=f"model forward [{rows}, {tokens // rows}]", steps=1, engine=0, runner=0,
                model=tally.counts["model"], layouts=0, kda_core_calls=calls[0],
                ops={f"{w}/{op}": n for (w, op), n in ops.most_common()})


def print_census_ops(rows: list[dict], top: int) -> None:
    """Per row, its commonest ops by where (means per step); then, for each step kind, the ops (KDA cores left
    out: fla on a GPU, the reference on a CPU) it launches beyond the model's own forward (the last row)."""
    for r in rows:
        print(f"  {r['kind']}: " + ", ".join(f"{k} {v:.3g}" for k, v in list(r["ops"].items())[:top]), flush=True)
    base = collections.Counter()
    for k, v in rows[-1]["ops"].items():
        base[k.split("/", 1)[1]] += 0 if k.startswith("kda core/") else v
    for r in rows[:-1]:
        mine = collections.Counter()
        for k, v in r["ops"].items():
            mine[k.split("/", 1)[1]] += 0 if k.startswith("kda core/") else v
        extra = sorted(((op, mine[op] - base[op]) for op in mine | base), key=lambda x: -abs(x[1]))
        print(f"  {r['kind']} minus the forward: " + ", ".join(f"{op} {d:+.3g}" for op, d in extra[:top] if d),
              flush=True)


def static_batches(model, prompts, streams, out_len) -> tuple[float, int]:
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    model.generate(ids[:streams], max_new_tokens=2, eos_token_id=None)  # untimed: graphs and autotuning
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), streams):
        model.generate(ids[i:i + streams], max_new_tokens=out_len, eos_token_id=None)
    sync()
    return time.perf_counter() - t0, len(prompts) * out_len


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="requests = waves x streams")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile-requests", type=int, default=None, help="requests in the profiled pass (default: streams)")
    ap.add_argument("--profile-output-len", type=int, default=24, help="output tokens in the profiled pass")
    ap.add_argument("--no-static", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also the pass under torch.profiler (first variant)")
    ap.add_argument("--sync-trace", action="store_true", help="also a short pass per variant counting the host's "
                    "waits for the device per step, by site (CUDA only)")
    ap.add_argument("--cprofile", action="store_true", help="also a short pass per variant (last round) with cProfile "
                    "on: the prompt-chunk steps' Python time by function, per step")
    ap.add_argument("--census", action="store_true", help="also a short pass per variant counting each step's "
                    "kernel-launching torch ops by where they launch (any device)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="the model's dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    ap.add_argument("--census-top", type=int, default=25, help="ops listed per step kind under --census")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants this many times, each round in the "
                    "reverse order of the one before: a process's first variant also pays for warm-up the untimed "
                    "wave misses (autotuning of new step shapes), so compare variants from round 2 on")
    ap.add_argument("--variants", default="", help="engines to time, ';'-separated, each extra EngineConfig "
                    "fields or k3.envs switches k=v,k=v (ints, true/false or names); '' = the defaults. E.g. "
                    "';split_mixed_steps=true', 'fla_lean=false;fla_lean=true' or ';triton_opt_in=_conv_varlen_triton'")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cfg = (_scaled(num_layers=16, hidden=128, heads=4, head_dim=32, vocab=8192, dense_inter=384, experts=64,
                   topk=8, expert_inter=64, q_lora=64, kv_lora=32, rope=16, block=4)
           if a.preset == "small-pattern" else K3Config.preset(a.preset))
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForCausalLM(cfg)
    if a.dtype == "bfloat16" or (a.dtype is None and dev.type == "cuda"):
        model = model.to(torch.bfloat16)  # the GPU's dtype; on a CPU, so that --census counts the casts it makes
    model.eval()
    g = torch.Generator().manual_seed(0)
    lo = 64  # clear of the special tokens
    make = lambda n, seed: torch.randint(lo, cfg.vocab_size, (n, a.input_len),  # noqa: E731
                                         generator=g.manual_seed(seed)).tolist()
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    res = dict(variants=[])
    variants = a.variants.split(";")
    order = [(r, v) for r in range(a.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
    for round_, variant in order:
        extra = {k: (v == "true" if v in ("true", "false") else int(v) if v.lstrip("-").isdigit() else v)
                 for k, v in (kv.split("=") for kv in variant.split(",") if kv)}
        # k3.envs switches (e.g. fla_lean=true) hold for this variant's engine; the rest are EngineConfig fields
        switches = {k: extra.pop(k) for k in list(extra) if k in envs.Switches.__dataclass_fields__}
        variant_env = contextlib.ExitStack()
        variant_env.enter_context(envs.override(**switches))
        settings = dict(memory_bytes=16 << 30 if dev.type == "cuda" else 1 << 28, block_size=256, match_unit=16,
                        max_batch_tokens=2048, max_num_seqs=a.streams,
                        num_state_slots=512 if dev.type == "cuda" else 2 * a.streams)
        ecfg = EngineConfig(**{**settings, **extra})  # a variant may override these (e.g. max_batch_tokens)
        eng = LLMEngine(model, None, ecfg)
        eng.warm_up()  # every graph, as `k3 serve` starts: no capture inside the timed or profiled passes
        rec = StepRecorder(eng)
        with torch.inference_mode():
            drive(rec, make(a.streams, 1), params, a.streams)  # untimed wave: autotuning, the allocator's pools
            rec.steps.clear()
            wall, n_out = drive(rec, make(a.waves * a.streams, 2), params, a.streams)
        steps = rec.steps
        row = dict(variant=variant or "defaults", round=round_ + 1, engine_tok_s=n_out / wall, engine_wall_s=wall,
                   steps=len(steps), by_kind=summarize_steps(steps))
        res["variants"].append(row)
        print(f"\n== engine [{row['variant']}] (round {round_ + 1}), {a.streams} streams, "
              f"{a.waves * a.streams} requests: "
              f"{n_out / wall:.0f} output tok/s, {len(steps)} steps in {wall:.2f} s", flush=True)
        print(table(row["by_kind"], ["kind", "steps", "total_ms", "wall_ms", "sched_ms", "run_ms", "sample_ms",
                                     "book_ms", "append_ms", "other_ms", "rows", "tokens", "blocks_read_over_real"]),
              flush=True)

        def short_pass(measure):
            """`measure(rec, prompts, params, streams)` over a short pass of other prompts."""
            rec.steps.clear()
            with torch.inference_mode():
                short = SamplingParams(max_tokens=a.profile_output_len, temperature=0, ignore_eos=True)
                return measure(rec, make(a.profile_requests or a.streams, 3), short, a.streams)
        if a.profile and len(res["variants"]) == 1:
            row["device"] = short_pass(device_profile)
            print("\n== under torch.profiler (slower host): per step, kernels' summed device time and count")
            print(table(row["device"], ["kind", "steps", "wall_ms", "kernel_ms", "kernels", "idle_share"]), flush=True)
        if a.cprofile and round_ == a.rounds - 1:
            row["python"] = short_pass(python_profile)
            print("\n== prompt-chunk steps under cProfile (slower host): Python time per step by function")
            print(table(row["python"], ["order", "function", "own_us", "cum_us", "calls"]), flush=True)
        if a.sync_trace and dev.type == "cuda" and round_ == a.rounds - 1:
            row["waits"] = short_pass(sync_trace)
            print("\n== host waits for the device per step (CUDA sync debug mode), commonest sites (per step)")
            print(table(row["waits"], ["kind", "steps", "waits_median", "waits_max", "sites"]), flush=True)
        if a.census and round_ == a.rounds - 1:
            row["census"] = short_pass(census)
            tokens = ecfg.max_batch_tokens
            with torch.inference_mode():
                row["census"].append(forward_census(model, tokens, max(1, tokens // a.input_len), cfg.vocab_size))
            print("\n== kernel-launching torch ops per step (means) by where they launch; last: the model's own "
                  "forward of a full step's tokens")
            print(table(row["census"], ["kind", "steps", "engine", "runner", "model", "layouts", "kda_core_calls"]),
                  flush=True)
            print_census_ops(row["census"], a.census_top)
        eng.close()
        variant_env.close()
        gc.collect()  # the closed engine's graphs (the pieces hold cycles) go now, not during the next one's captures
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not a.no_static:
        with torch.inference_mode():
            sw, sn = static_batches(model, make(a.waves * a.streams, 2), a.streams, a.output_len)
        res["static_tok_s"] = sn / sw
        print(f"static generate, batches of {a.streams}: {sn / sw:.0f} output tok/s; engine/static = " +
              ", ".join(f"{v['variant']} (round {v['round']}): {v['engine_tok_s'] / res['static_tok_s']:.1%}"
                        for v in res["variants"]),
              flush=True)
    if dev.type == "cuda":
        save("profile_serve", res)


if __name__ == "__main__":
    main()
