"""The engine step's host side (issue 21): what the device is asked to send back, and what the host already knows.

- The serving layout carries each step's prefill `cu_seqlens` on the host beside the device copy, and every KDA
  layer hands fla that one host tensor (fla plans its chunks from it, cached by identity: once a step, and without
  reading the device copy back). Checked with fla's entry points replaced by recorders that compute the reference.
- A step reads the device once, for the sampled ids (and their logprobs in the same copy): a spy on every way of
  reading a tensor on the host counts them for decode, mixed and sampled steps, so a new read fails here.
"""
import inspect
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

import k3.model.kda as kda_mod
import k3.ops.kda_core as core_mod
from k3 import K3Config, K3ForCausalLM
from k3.model.cache import BatchCacheView
from k3.ops import kda_fla
from k3.ops.norm import rms_norm
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from k3.serve.sampling import read_back
from test_serve_engine import model, prompt  # noqa: F401  (the serving tests' tiny model and prompts)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # profile_serve's device_waits

GREEDY = dict(temperature=0.0)


def make_engine(model, **kw) -> LLMEngine:
    cfg = dict(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=12, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))


def test_layout_carries_prefill_cu_seqlens_on_the_host_and_the_device():
    """Decodes (1 token) and prompt chunks (5 and 3 tokens) in one step: the chunks' offsets are [0, 5, 8] on the
    device and, equal, in a host int64 tensor."""
    view = BatchCacheView()
    view.set_layout([1, 5, 1, 3], [7, 5, 9, 12], "cpu")
    assert view.prefill_cu_seqlens.tolist() == [0, 5, 8]
    host = view.prefill_cu_seqlens_cpu
    assert host.device.type == "cpu" and host.dtype == torch.long and host.tolist() == [0, 5, 8]
    view.set_layout([1, 1], [3, 4], "cpu")  # decodes only: no chunk, offsets [0]
    assert view.prefill_cu_seqlens_cpu.tolist() == view.prefill_cu_seqlens.tolist() == [0]


class FlaRecorder:
    """Stands in for k3's fla entry points on a CPU: records each call's cu_seqlens pair and computes the
    reference, so the engine's tokens stay those of the reference path."""

    def __init__(self):
        self.calls, self.step = [], 0

    def gated(self, q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, *, initial_state=None,
              output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, recurrent=None, state_in_place=False,
              plan=None, qk_normalized=False):
        self.calls.append((self.step, cu_seqlens, cu_seqlens_cpu))
        return core_mod.kda_core(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 recurrent=bool(recurrent), state_in_place=state_in_place, backend="reference",
                                 qk_normalized=qk_normalized)


def run_steps(eng: LLMEngine, requests, recorder: FlaRecorder | None = None) -> list[list[int]]:
    """Requests (prompt, params, step to arrive at) to completion → each one's output ids."""
    ids, final, step = [None] * len(requests), {}, 0
    while step == 0 or eng.has_unfinished() or any(i is None for i in ids):
        for k, (p, params, at) in enumerate(requests):
            if at == step:
                ids[k] = eng.add_request(p, params)
        if recorder is not None:
            recorder.step = step
        for o in eng.step():
            if o.finished:
                final[o.request_id] = list(o.output_ids)
        step += 1
    return [final[i] for i in ids]


def test_every_kda_layer_hands_fla_the_steps_host_cu_seqlens(model, monkeypatch):
    """Engine steps with prompt chunks beside decodes, the KDA core on 'fla' (recorders on a CPU): every chunked
    call gets cu_seqlens_cpu, a host tensor equal to its device cu_seqlens, and all the KDA layers of one step get
    the same object (fla's chunk plan is cached by identity). The tokens equal the reference path's."""
    requests = [(prompt(1, 5), SamplingParams(max_tokens=8, **GREEDY), 0),
                (prompt(2, 9), SamplingParams(max_tokens=6, **GREEDY), 0),
                (prompt(3, 30), SamplingParams(max_tokens=4, **GREEDY), 2),
                (prompt(4, 17), SamplingParams(max_tokens=5, **GREEDY), 3)]
    want = run_steps(make_engine(model, decode_graphs=False), requests)
    rec = FlaRecorder()
    monkeypatch.setattr(core_mod, "fla_kda_gated", rec.gated)
    monkeypatch.setattr(kda_mod, "fla_output_gate", lambda o, g, w, eps: rms_norm(o, w, eps) * torch.sigmoid(g))
    with core_mod.force_backend("fla"):
        got = run_steps(make_engine(model, decode_graphs=False), requests, rec)
    assert got == want
    chunked = [(step, dev, host) for step, dev, host in rec.calls if dev is not None]
    kda_layers = sum(not model.config.is_mla(l) for l in range(model.config.num_hidden_layers))
    per_step = Counter(step for step, _, _ in chunked)
    assert len(per_step) >= 4 and set(per_step.values()) == {kda_layers}, per_step
    for step in per_step:
        hosts = {id(host) for s, _, host in chunked if s == step}
        assert len(hosts) == 1  # one host tensor for the whole step
    for _, dev, host in chunked:
        assert host is not None and host.device.type == "cpu" and host.dtype == torch.long
        assert host.tolist() == dev.tolist()


def test_fla_entry_points_pass_the_host_cu_seqlens_through(stub_fla):
    """k3.ops.kda_fla hands fla's chunk_kda the caller's host cu_seqlens object itself (fla caches by identity),
    and a CPU copy of a host cu_seqlens when none is given. fla is replaced by a module that records its kwargs."""
    seen = []

    def chunk_kda(q, k, v, g, beta, **kw):
        seen.append(kw)
        return v.clone(), None
    stub_fla(chunk_kda)
    T, H, K = 8, 2, 4
    q, k, v, f = (torch.randn(1, T, H, K) for _ in range(4))
    beta = torch.randn(1, T, H)
    dev, host = torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8])
    kda_fla.fla_kda_gated(q, k, v, f, beta, torch.zeros(H), torch.zeros(H * K), -5.0, cu_seqlens=dev,
                          cu_seqlens_cpu=host, recurrent=False)
    kda_fla.fla_kda_chunk(q, k, v, f.sigmoid().log(), beta.sigmoid(), cu_seqlens=dev, cu_seqlens_cpu=host)
    assert len(seen) == 2
    for kw in seen:
        assert kw["cu_seqlens_cpu"] is host and kw["cu_seqlens"] is dev
    kda_fla.fla_kda_chunk(q, k, v, f.sigmoid().log(), beta.sigmoid(), cu_seqlens=dev)  # host copy from a CPU one
    assert seen[-1]["cu_seqlens_cpu"].tolist() == [0, 3, 8]


# Every way a step can make the host wait for the device: reading a tensor's values, a copy to the device from
# pageable memory (`torch.tensor(..., device=)`, `.to(device)` or `.copy_` without non_blocking, indexing with a
# Python list). On a CPU nothing waits, so the spy counts the calls where they are written.
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# Where the serving step's own code lives (the model's KDA and MLA layers run k3.ops' CPU references here, whose
# checks read values; on CUDA fla and k3's kernels run instead, see the CUDA test below).
SERVING = ("k3/serve/", "k3/model/cache.py", "k3/model/kda.py", "k3/model/mla.py", "k3/model/generate.py")


class SyncSpy:
    def __init__(self, monkeypatch):
        self.sites, self.on = Counter(), False
        for name in READS:
            self._wrap(monkeypatch, torch.Tensor, name, lambda *a, **k: True)
        self._wrap(monkeypatch, torch, "tensor", lambda *a, **k: k.get("device") is not None)
        to_device = lambda self_, *a, **k: (not k.get("non_blocking") and (  # noqa: E731
            "device" in k or any(isinstance(x, (torch.device, str)) for x in a)))
        self._wrap(monkeypatch, torch.Tensor, "to", to_device)
        self._wrap(monkeypatch, torch.Tensor, "copy_", lambda self_, src, non_blocking=False: not non_blocking
                   and src.device != self_.device)
        listed = lambda self_, index, *a: isinstance(index, list) or (  # noqa: E731
            isinstance(index, tuple) and any(isinstance(i, list) for i in index))
        self._wrap(monkeypatch, torch.Tensor, "__getitem__", listed)
        self._wrap(monkeypatch, torch.Tensor, "__setitem__", listed)

    def _wrap(self, monkeypatch, owner, name, counts):
        inner = getattr(owner, name)

        def spied(*a, **k):
            if self.on and counts(*a, **k):
                self.on = False  # a spied call inside another is not a second wait
                try:
                    frame = sys._getframe(1)
                    path = frame.f_code.co_filename.replace("\\", "/")
                    if "/k3/" in path:
                        self.sites[(path.split("/k3/")[-1], frame.f_code.co_name, name)] += 1
                    return inner(*a, **k)
                finally:
                    self.on = True
            return inner(*a, **k)
        monkeypatch.setattr(owner, name, spied)

    def step(self, eng: LLMEngine):
        """One engine step → (its outputs, the host waits of the serving code: {(file, function, call): count})."""
        self.sites.clear()
        self.on = True
        try:
            with torch.inference_mode():
                outs = eng.step()
        finally:
            self.on = False
        return outs, Counter({k: v for k, v in self.sites.items() if ("k3/" + k[0]).startswith(SERVING)})



@pytest.mark.parametrize("split", [False, True])
def test_a_step_reads_the_device_once(model, monkeypatch, split):
    """Decode steps (graph-shaped), mixed steps (split or not) and a prompt-scoring step, with greedy rows, seeded
    top-p/top-k/min-p rows, logprobs, logit_bias, penalties and min_tokens: the serving code waits for the device
    once a step, in read_back (the sampled ids and logprobs together); a step that also scores a prompt reads its
    prompt logprobs once more. Every other host list goes to the device pinned and non-blocking. Synchronous
    steps (async output off): with it a step reads back the step before it, so its outputs and reads do not pair
    as counted here."""
    eng = make_engine(model, decode_graphs=True, split_mixed_steps=split, max_batch_tokens=10, async_output=False)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3, logprobs=2,
                             logit_bias={11: 2.0}, min_tokens=2, stop_token_ids=[5])
    penalised = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5,
                               presence_penalty=0.3, logprobs=0)
    eng.add_request(prompt(1, 5), SamplingParams(max_tokens=12, **GREEDY))
    eng.add_request(prompt(2, 6), sampled)
    eng.add_request(prompt(3, 4), penalised)
    plans = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    spy = SyncSpy(monkeypatch)
    kinds = Counter()
    for step in range(12):
        if step == 3:
            eng.add_request(prompt(4, 17), SamplingParams(max_tokens=3, **GREEDY))
        if step == 6:
            eng.add_request(prompt(5, 9), SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))
        outs, waits = spy.step(eng)
        seqs, lens = plans[-1]
        scoring = any(s.params.prompt_logprobs is not None and s.num_computed - n < s.prompt_len - 1
                      for s, n in zip(seqs, lens))
        prefill = sum(s.num_computed - n < s.prompt_len for s, n in zip(seqs, lens))
        kind = "scoring" if scoring else "prefill" if prefill == len(seqs) else "mixed" if prefill else "decode"
        want = Counter({("serve/sampling.py", "read_back", "tolist"): bool(outs) + scoring})
        assert waits == want, (step, kind, waits)
        kinds[kind] += 1
    assert kinds["decode"] >= 3 and kinds["mixed"] >= 2 and kinds["scoring"] >= 1, kinds


def test_device_waits_records_event_syncs_which_the_sync_debug_mode_misses(monkeypatch):
    """cudaEventSynchronize is no sync-debug-mode warning (read_back's wait since its copy went async): the trace
    records each Event.synchronize at its caller's line, marks one on an already completed event, and puts the
    method back after the block (here with stand-in events: no CUDA needed)."""
    from profile_serve import device_waits

    waited = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: waited.append(event))
    stub = torch.cuda.Event.synchronize
    pending, done = types.SimpleNamespace(query=lambda: False), types.SimpleNamespace(query=lambda: True)
    with device_waits() as sites:
        line = inspect.currentframe().f_lineno + 1
        torch.cuda.Event.synchronize(pending)
        torch.cuda.Event.synchronize(done)
    assert waited == [pending, done] and torch.cuda.Event.synchronize is stub
    assert [s.rsplit("/", 1)[-1] for s in sites] == [f"test_serve_host_syncs.py:{line}",
                                                     f"test_serve_host_syncs.py:{line + 1} (complete)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [False, True])
def test_cuda_steps_wait_for_the_device_once(model, split):
    """On CUDA with decode graphs, device_waits reports every wait of the host for the device (CUDA's sync debug
    mode: value reads, copies from pageable memory, stream syncs; and every Event.synchronize, which that mode
    does not see). The same requests run twice, the first time to capture the graphs; in the second, each step's
    waits from the serving code (k3.serve, the model's serving layouts, the sampler) are one read_back when it
    samples (its event, behind the copy into pinned memory), and no other that waits: a staging area's guard
    (k3.serve.staging) synchronizes on the copy two loads back, which a read_back has already waited past (with one
    pinned buffer the guard waited on the copy of the step still on the device, now and then: session 47).
    fp32: no kernel to compile (the KDA references' own checks read values, outside the serving code;
    `profile_serve.py --sync-trace` lists fla's, in bf16)."""
    from profile_serve import device_waits  # benchmarks/: the one home of the trace

    cuda = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cuda.load_state_dict(model.state_dict())
    eng = make_engine(cuda, decode_graphs=True, split_mixed_steps=split, max_batch_tokens=10, prefix_caching=False)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, logprobs=2, repetition_penalty=1.1)
    requests = [(prompt(1, 5), SamplingParams(max_tokens=10, **GREEDY), 0), (prompt(2, 6), sampled, 0),
                (prompt(3, 17), SamplingParams(max_tokens=4, **GREEDY), 3)]
    lines, first = inspect.getsourcelines(read_back)
    read_back_sites = {f"k3/serve/sampling.py:{n}" for n in range(first, first + len(lines))}
    measured_steps = 0
    for measured in (False, True):
        step = 0
        while step < 4 or eng.has_unfinished():
            for p, params, at in requests:
                if at == step:
                    eng.add_request(p, params)
            with torch.inference_mode(), device_waits() as sites:
                outs = eng.step()
            step += 1
            if measured:
                serving = [s for s in sites if s.startswith(SERVING)]
                reads = [s for s in serving if s.removesuffix(" (complete)") in read_back_sites]
                assert len(reads) == bool(outs), (step, sites)
                # any other synchronizing call of the serving code is on an event that had completed: no wait
                assert all(s.endswith(" (complete)") for s in serving if s not in reads), (step, sites)
                measured_steps += 1
    assert measured_steps >= 8


class StandInEvent:
    """Records the order of a staging area's event calls (no CUDA needed)."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("wait", self.name))

    def record(self):
        self.log.append(("record", self.name))


def test_pinned_staging_waits_only_for_the_copy_two_loads_back():
    """Each load waits on the event its own host buffer recorded two loads earlier (never the previous load's,
    whose copy may still be queued behind the step on the device), fills that buffer only after the wait, and the
    device buffer gets every load's values. The pinned path with stand-ins for the events and the pinned memory."""
    from k3.serve.staging import TURNS, PinnedStaging

    log = []
    dst = torch.zeros(5, dtype=torch.long)
    st = PinnedStaging(dst)
    assert st.hosts == [] and TURNS == 2  # a CPU buffer: loads are plain copies
    st.load(torch.arange(5))
    assert dst.tolist() == [0, 1, 2, 3, 4] and log == []
    st.hosts = [torch.zeros(5, dtype=torch.long) for _ in range(TURNS)]
    st.copied = [StandInEvent(log, i) for i in range(TURNS)]
    for k in range(5):
        before = [h.clone() for h in st.hosts]
        st.load(torch.full((5,), 10 + k))
        assert dst.tolist() == [10 + k] * 5
        assert log[-2:] == [("wait", k % TURNS), ("record", k % TURNS)]
        # the other buffer (the previous load's copy source) is untouched
        assert torch.equal(st.hosts[(k + 1) % TURNS], before[(k + 1) % TURNS])
    recorded_at = {}
    for i, (what, name) in enumerate(log):
        if what == "wait" and name in recorded_at:
            assert recorded_at[name] == i - 3  # the record two loads (four calls) back, one load between
        if what == "record":
            recorded_at[name] = i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_keeps_each_queued_copys_source():
    """Loads queued behind a long kernel, each read on the stream by a clone: every clone sees its own load's
    values (a load that overwrote a queued copy's pinned source would hand a clone the next load's), and the third
    load waited for the first copy only (the first two returned while the kernel still ran)."""
    from k3.serve.staging import PinnedStaging

    dst = torch.zeros(1 << 16, dtype=torch.long, device="cuda")
    st = PinnedStaging(dst)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of a busy stream
    seen = []
    for k in range(6):
        st.load(torch.full(dst.shape, k))
        if k == 1:
            assert not st.copied[0].query()  # the first copy still waits behind the kernel
        seen.append(dst.clone())
    torch.cuda.synchronize()
    assert [int(s.min()) for s in seen] == [int(s.max()) for s in seen] == list(range(6))
