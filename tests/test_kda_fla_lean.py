"""k3.ops.kda_fla_lean: the inference entries to fla's forward internals (K3_FLA_LEAN=1).

On the CPU: the chunk plan against a plain count of chunks, built once per step; the selector in k3.ops.kda_fla
(lean only when switched on, with no gradient, on fla's 0.6 series; any other version falls back to fla's public
functions with one log line), with fla replaced by recorders. On CUDA (marked gpu): equal to fla's public
`chunk_kda` and `rms_norm_gated` over varlen batches with length-1 and length-65 sequences and initial states.
"""
import itertools
import logging
import math
import sys
import types

import pytest
import torch

from k3 import envs
from k3.ops import kda_fla, kda_fla_lean
from k3.ops.kda_fla_lean import CHUNK_SIZE, chunk_plan


@pytest.fixture(autouse=True)
def fresh_version_check(fresh_fla_caches):
    """FakeFla's modules judged on their own, never cached for later tests (fresh_fla_caches); no chunk plan kept."""
    kda_fla_lean._last_plan[:] = [None, None, None]
    yield
    kda_fla_lean._last_plan[:] = [None, None, None]


def offsets(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("lens", [[1, 65, 64, 128, 3], [0, 5, 1], [200]])
def test_chunk_plan_counts_each_documents_chunks(lens):
    """Chunk (document, index within it) for every started block of 64 tokens, and each document's first chunk."""
    cu = offsets(lens)
    plan = chunk_plan(torch.tensor(cu), torch.tensor(cu))
    counts = [math.ceil(n / CHUNK_SIZE) for n in lens]
    assert plan.chunk_indices.tolist() == [[s, i] for s, c in enumerate(counts) for i in range(c)]
    assert plan.chunk_offsets.tolist() == offsets(counts)
    assert plan.chunk_indices.dtype == plan.chunk_offsets.dtype == torch.int64
    assert plan.num_seqs == len(lens)


def test_chunk_plan_is_built_once_a_step():
    """The same two tensors (one step's layers) give the same plan; a new step's tensors a new one, even with
    equal values; without a host copy the device values are read."""
    cu = [0, 3, 70]
    dev, host = torch.tensor(cu), torch.tensor(cu)
    first = chunk_plan(dev, host)
    assert all(chunk_plan(dev, host) is first for _ in range(11))
    dev2, host2 = torch.tensor(cu), torch.tensor(cu)
    second = chunk_plan(dev2, host2)
    assert second is not first and second.chunk_indices.tolist() == first.chunk_indices.tolist()
    assert chunk_plan(dev2).chunk_offsets.tolist() == [0, 1, 3]


@pytest.mark.parametrize("cu", [[0, 5, 3], [0]])
def test_chunk_plan_refuses_bad_offsets(cu):
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        chunk_plan(torch.tensor(cu), torch.tensor(cu))


def test_lean_runs_only_on_the_fla_series_it_was_written_for(caplog):
    with caplog.at_level(logging.WARNING, logger="k3.ops.kda_fla_lean"):
        assert kda_fla_lean.lean_supported("0.6.0") and kda_fla_lean.lean_supported("0.6.3")
        assert not caplog.records
        assert not kda_fla_lean.lean_supported("0.7.0")
        assert not kda_fla_lean.lean_supported("0.7.0")
        assert not kda_fla_lean.lean_supported("0.5.2")
    assert [r.getMessage().split(" is not")[0] for r in caplog.records] == ["fla 0.7.0", "fla 0.5.2"]


class FakeFla:
    """fla's modules replaced: the public chunk_kda and rms_norm_gated record their calls; the lean stages
    (k3.ops.kda_fla_lean._stages) record theirs and return tensors of the right shapes."""

    def __init__(self, monkeypatch, version):
        self.public, self.stages = [], []
        fla = types.ModuleType("fla")
        fla.__version__ = version
        kda = types.ModuleType("fla.ops.kda")
        kda.chunk_kda = self.chunk_kda
        norm = types.ModuleType("fla.modules.norm.fused_norm_gate")
        norm.rms_norm_gated = lambda o, g, w, b, activation, eps: self.public.append("norm") or o * 2
        for name, mod in (("fla", fla), ("fla.ops", types.ModuleType("fla.ops")), ("fla.ops.kda", kda),
                          ("fla.modules", types.ModuleType("fla.modules")),
                          ("fla.modules.norm", types.ModuleType("fla.modules.norm")),
                          ("fla.modules.norm.fused_norm_gate", norm)):
            monkeypatch.setitem(sys.modules, name, mod)
        stages = dict(l2norm=self.stage("l2norm", lambda x, **kw: (x, None)),
                      beta_sigmoid=self.stage("beta_sigmoid", lambda x, **kw: x.float()),
                      gate_cumsum=self.stage("gate_cumsum", lambda g, **kw: g.float()),
                      intra=self.stage("intra", lambda q, k, v, **kw: (k, v, None, k, q, None)),
                      states=self.stage("states", lambda k, w, u, initial_state, **kw: (None, u, initial_state)),
                      output=self.stage("output", lambda q, v, **kw: v),
                      gated_norm=self.stage("gated_norm", lambda x, g, w, b, **kw: (x * 3, None, None, x)),
                      rcp_ln2=1 / math.log(2))
        monkeypatch.setattr(kda_fla_lean, "_stages", lambda: stages)

    def chunk_kda(self, q, k, v, g, beta, **kw):
        self.public.append("chunk_kda")
        return v.clone(), kw["initial_state"]

    def stage(self, name, fn):
        def call(*args, **kw):
            self.stages.append((name, kw))
            return fn(*args, **kw)
        return call


def kda_args(lens, H=2, K=8, requires_grad=False):
    N = sum(lens)
    q, k, v, f = (torch.randn(1, N, H, K, requires_grad=requires_grad) for _ in range(4))
    beta = torch.randn(1, N, H)
    cu = offsets(lens)
    return (q, k, v, f, beta, torch.zeros(H), torch.zeros(H * K), -5.0), dict(
        initial_state=torch.randn(len(lens), H, K, K), output_final_state=True, cu_seqlens=torch.tensor(cu),
        cu_seqlens_cpu=torch.tensor(cu), recurrent=False)


def test_lean_path_is_taken_only_when_switched_on_without_gradients_or_compile(monkeypatch):
    assert envs.parse({}).fla_lean and envs.parse({"K3_FLA_LEAN": "1"}).fla_lean  # on by default
    assert not envs.parse({"K3_FLA_LEAN": "0"}).fla_lean
    fake = FakeFla(monkeypatch, "0.6.0")
    args, kw = kda_args([1, 65, 7])
    with torch.inference_mode():
        with envs.override(fla_lean=False):
            kda_fla.fla_kda_gated(*args, **kw)  # switched off: fla's public entry
        assert fake.public == ["chunk_kda"] and not fake.stages
        with envs.override(fla_lean=True):
            for _ in range(3):  # three layers of one step
                o, state = kda_fla.fla_kda_gated(*args, **kw)
    assert fake.public == ["chunk_kda"]
    names = [n for n, _ in fake.stages]
    assert names == ["l2norm", "l2norm", "beta_sigmoid", "gate_cumsum", "intra", "states", "output"] * 3
    indices = {id(kw["chunk_indices"]) for n, kw in fake.stages if n in ("gate_cumsum", "intra", "states", "output")}
    assert len(indices) == 1  # one plan for the step's layers
    plan_kw = next(kw for n, kw in fake.stages if n == "states")
    assert plan_kw["chunk_indices"].tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]
    assert plan_kw["chunk_offsets"].tolist() == [0, 1, 3, 4]
    assert plan_kw["cu_seqlens"] is kw["cu_seqlens"]
    assert torch.equal(o, args[2]) and torch.equal(state, kw["initial_state"])  # the recorders' pass-through
    gate_kw = next(kw for n, kw in fake.stages if n == "gate_cumsum")
    assert gate_kw["lower_bound"] == -5.0 and gate_kw["chunk_size"] == CHUNK_SIZE

    fake.public.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with envs.override(fla_lean=True), torch.inference_mode():  # torch.compile tracing: fla's public entry
        kda_fla.fla_kda_gated(*args, **kw)
    assert fake.public == ["chunk_kda"]
    monkeypatch.undo()
    fake = FakeFla(monkeypatch, "0.6.0")
    grad_args, kw = kda_args([4, 3], requires_grad=True)
    with envs.override(fla_lean=True):  # training: the autograd entry even when switched on
        kda_fla.fla_kda_gated(*grad_args, **kw)
    assert fake.public == ["chunk_kda"]


def test_other_fla_versions_fall_back_to_the_public_entries_with_one_log_line(monkeypatch, caplog):
    fake = FakeFla(monkeypatch, "0.7.0")
    args, kw = kda_args([5, 64])
    o, g, w = torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2, 8), torch.ones(8)
    with caplog.at_level(logging.WARNING, logger="k3.ops.kda_fla_lean"), envs.override(fla_lean=True), \
            torch.inference_mode():
        for _ in range(2):
            kda_fla.fla_kda_gated(*args, **kw)
            kda_fla.fla_output_gate(o, g, w, 1e-6)
    assert fake.public == ["chunk_kda", "norm"] * 2 and not fake.stages
    assert len([r for r in caplog.records if "fla 0.7.0" in r.getMessage()]) == 1


def test_lean_gated_norm_hands_fla_rows_and_restores_the_shape(monkeypatch):
    fake = FakeFla(monkeypatch, "0.6.1")
    o = torch.randn(1, 6, 2, 8)
    gate = torch.randn(1, 6, 16)[..., :16].view(1, 6, 2, 8)
    with envs.override(fla_lean=True), torch.inference_mode():
        y = kda_fla.fla_output_gate(o, gate, torch.ones(8), 1e-5)
    assert torch.equal(y, o * 3) and not fake.public
    (name, kw), = fake.stages
    assert name == "gated_norm" and kw == dict(activation="sigmoid", eps=1e-5, is_rms_norm=True)


# ---- CUDA: equal to fla's public entries ----

def _fla_ok() -> bool:
    return torch.cuda.is_available() and kda_fla.fla_available()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_fla = pytest.mark.skipif(torch.cuda.is_available() and not _fla_ok() and not envs.current().require_fla,
                               reason="flash-linear-attention >= 0.6.0 not importable")


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.gpu
@needs_cuda
@needs_fla
@pytest.mark.parametrize("lens", [[1, 65, 7, 130, 64], None])  # varlen; None: dense rows [2, 97]
@pytest.mark.parametrize("with_state", [True, False])
def test_lean_chunk_equals_fla_public_chunk_kda_on_cuda(lens, with_state):
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, K = 4, 128
    B, T = (1, sum(lens)) if lens else (2, 97)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v, f = (r(B, T, H, K).bfloat16() for _ in range(4))
    beta = r(B, T, H).bfloat16()
    A_log, dt_bias = r(H) * 0.5, r(H * K)
    n = len(lens) if lens else B
    h0 = r(n, H, K, K) * 0.1 if with_state else None
    cu = torch.tensor(offsets(lens), device="cuda") if lens else None
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu,
              cu_seqlens_cpu=None if cu is None else cu.cpu(), recurrent=False)
    with torch.inference_mode():
        with envs.override(fla_lean=False):
            o_pub, s_pub = kda_fla.fla_kda_gated(q, k, v, f, beta, A_log, dt_bias, -5.0, **kw)
        with envs.override(fla_lean=True):
            o_lean, s_lean = kda_fla.fla_kda_gated(q, k, v, f, beta, A_log, dt_bias, -5.0, **kw)
            assert kda_fla.lean_enabled()
    assert o_lean.shape == o_pub.shape and o_lean.dtype == o_pub.dtype
    assert rel_err(o_lean, o_pub) < 2e-3 and rel_err(s_lean, s_pub) < 2e-3
    if lens:  # a length-1 and a length-65 document compared alone, where a chunk-plan slip would show first
        for s in (0, 1):
            a, b = offsets(lens)[s], offsets(lens)[s + 1]
            assert rel_err(o_lean[:, a:b], o_pub[:, a:b]) < 2e-3


@pytest.mark.gpu
@needs_cuda
@needs_fla
def test_lean_gated_norm_equals_fla_public_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(1)
    o = torch.randn(1, 300, 4, 128, generator=gen, device="cuda").bfloat16()
    wide = torch.randn(1, 300, 4 * 128 * 2, generator=gen, device="cuda").bfloat16()
    gate = wide[..., :512].view(1, 300, 4, 128)  # a strided view, as the fused projection hands it
    w = torch.rand(128, generator=gen, device="cuda") + 0.5
    with torch.inference_mode():
        with envs.override(fla_lean=False):
            ref = kda_fla.fla_output_gate(o, gate, w, 1e-6)
        with envs.override(fla_lean=True):
            lean = kda_fla.fla_output_gate(o, gate, w, 1e-6)
    assert lean.shape == ref.shape and lean.dtype == ref.dtype
    assert rel_err(lean, ref) < 1e-3


def test_a_callers_graph_plan_reaches_the_stages_and_nothing_else_takes_it(monkeypatch):
    """A plan the caller made (a CUDA-graph layout's, k3.serve.runner.StaticKDAView) is the one every chunk stage
    reads, in fla's graph mode; a step's own plan runs without it; the public entry, which would plan from the host
    offsets once at capture, refuses a graph plan."""
    fake = FakeFla(monkeypatch, "0.6.0")
    args, kw = kda_args([3, 0, 70])
    cu = kw["cu_seqlens"]
    graph = kda_fla_lean.ChunkPlan(cu, kw["cu_seqlens_cpu"], torch.tensor([[0, 0], [2, 0], [2, 1], [-1, 0]]),
                                   torch.tensor([0, 1, 1, 3]), graph=True)
    with envs.override(fla_lean=True), torch.inference_mode():
        kda_fla.fla_kda_gated(*args, plan=graph, **kw)
        chunked = [kw_ for n, kw_ in fake.stages if n in ("gate_cumsum", "intra", "output")]
        assert len(chunked) == 3 and all(k["use_graph"] and k["chunk_indices"] is graph.chunk_indices for k in chunked)
        assert next(k for n, k in fake.stages if n == "states")["chunk_offsets"] is graph.chunk_offsets
        fake.stages.clear()
        kda_fla.fla_kda_gated(*args, **kw)  # no plan given: the step's own, built here, not in graph mode
        chunked = [kw_ for n, kw_ in fake.stages if n in ("gate_cumsum", "intra", "output")]
        assert not any(k["use_graph"] for k in chunked) and chunked[0]["chunk_indices"].shape[0] == 3
    with envs.override(fla_lean=False), torch.inference_mode(), pytest.raises(ValueError, match="lean entry"):
        kda_fla.fla_kda_gated(*args, plan=graph, **kw)
    assert fake.public == []


@pytest.mark.gpu
@needs_cuda
@needs_fla
def test_graph_plan_captured_once_replays_any_layout_of_its_bucket_on_cuda():
    """The prefill graphs' fixed-shape KDA layout (k3.serve.runner.StaticKDAView: the step's documents, a pad
    document, empty ones; fla's chunk plan padded with sentinel rows) through the lean chunked KDA, captured in a
    CUDA graph on one layout and replayed on others: each replay's outputs and final states equal an eager run over
    the same documents with a plan of their own (no empty documents, no sentinel rows); an empty document's final
    state is its initial state."""
    from types import SimpleNamespace

    from k3.serve.runner import StaticKDAView

    gen = torch.Generator(device="cuda").manual_seed(2)
    H, K, tokens, rows = 2, 128, 512, 6
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    view = StaticKDAView(SimpleNamespace(device=torch.device("cuda"), scratch_slot=0), 1, tokens, rows)
    S = view.S
    q, k, v, f = (r(1, tokens, H, K).bfloat16() for _ in range(4))
    beta = r(1, tokens, H).bfloat16()
    A_log, dt_bias = r(H) * 0.5, r(H * K)
    h0 = r(S, H, K, K) * 0.1
    layouts = [[100, 1, 64], [5, 130, 64, 1, 200, 77], [512], [63, 65], [1] * rows, []]

    def graph_run():
        return kda_fla.fla_kda_gated(q, k, v, f, beta, A_log, dt_bias, -5.0, initial_state=h0, output_final_state=True,
                                     cu_seqlens=view.cu_seqlens, cu_seqlens_cpu=view.cu_cpu, recurrent=False,
                                     plan=view.prefill_plan)

    with envs.override(fla_lean=True), torch.inference_mode():
        view.load(layouts[0], list(range(len(layouts[0]))))
        graph_run()  # the eager pass: compiles and tunes outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o_g, s_g = graph_run()
        for lens in layouts:
            view.load(lens, list(range(len(lens))))
            g.replay()
            docs = [*lens, tokens - sum(lens)]
            cu = [0, *itertools.accumulate(docs)]
            live = [i for i, d in enumerate(docs) if d]  # fla's own plan takes no empty documents
            cu_live = [0, *itertools.accumulate(docs[i] for i in live)]
            o, s = kda_fla.fla_kda_gated(q, k, v, f, beta, A_log, dt_bias, -5.0, initial_state=h0[live].contiguous(),
                                         output_final_state=True, recurrent=False,
                                         cu_seqlens=torch.tensor(cu_live, device="cuda"),
                                         cu_seqlens_cpu=torch.tensor(cu_live))
            torch.cuda.synchronize()
            assert cu == view.cu_cpu[:len(cu)].tolist()
            assert rel_err(o_g, o) < 1e-5, lens
            assert rel_err(s_g[live], s) < 1e-5, lens
            empty = [i for i in range(S) if i not in live]
            assert torch.equal(s_g[empty], h0[empty]), lens
