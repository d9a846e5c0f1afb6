"""The engine step's host side (issue 21): what the device is asked to send back, and what the host already knows.

- The serving layout carries each step's prefill `cu_seqlens` on the host beside the device copy, and every KDA
  layer hands fla that one host tensor (fla plans its chunks from it, cached by identity: once a step, and without
  reading the device copy back). Checked with fla's entry points replaced by recorders that compute the reference.
- A step reads the device once, for the sampled ids (and their logprobs in the same copy): a spy on every way of
  reading a tensor on the host counts them for decode, mixed and sampled steps, so a new read fails here.
"""
import sys
import types
from collections import Counter

import pytest
import torch

import k3.model.kda as kda_mod
import k3.ops.kda_core as core_mod
from k3.model.cache import BatchCacheView
from k3.ops import kda_fla
from k3.ops.norm import rms_norm
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from test_serve_engine import model, prompt  # noqa: F401  (the serving tests' tiny model and prompts)

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
              output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, recurrent=None, state_in_place=False):
        self.calls.append((self.step, cu_seqlens, cu_seqlens_cpu))
        return core_mod.kda_core(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 recurrent=bool(recurrent), state_in_place=state_in_place, backend="reference")


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


def test_fla_entry_points_pass_the_host_cu_seqlens_through(monkeypatch):
    """k3.ops.kda_fla hands fla's chunk_kda the caller's host cu_seqlens object itself (fla caches by identity),
    and a CPU copy of a host cu_seqlens when none is given. fla is replaced by a module that records its kwargs."""
    seen = []

    def chunk_kda(q, k, v, g, beta, **kw):
        seen.append(kw)
        return v.clone(), None
    fake = types.ModuleType("fla.ops.kda")
    fake.chunk_kda = chunk_kda
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                      ("fla.ops.kda", fake)):
        monkeypatch.setitem(sys.modules, name, mod)
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
