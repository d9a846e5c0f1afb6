"""Piecewise graphs for the engine's eager steps (k3.serve.prefill_graphs, EngineConfig.prefill_graphs): a step
padded to a token bucket runs as pieces broken at each mixer's core, the cores eagerly over the step's real rows.
On a CPU the pieces run eagerly in one pass with the same padding, static ids and breaks, so every output must
equal the plain engine's and the model's one-shot `generate`: tokens, sampled logprobs, prompt logprobs, with
chunked prefill, split and unsplit mixed steps, preemption and prefix hits in play; pad rows must never reach a
real row."""
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from k3.serve import prefill_graphs as pg
from test_serve_engine import GREEDY, assert_pool_empty, model, prompt, reference  # noqa: F401


def make(model, pieces: bool, **kw) -> LLMEngine:
    cfg = dict(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=24, max_num_seqs=8,
               decode_graphs=True, prefill_graphs=pieces)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))


def drive(eng: LLMEngine, requests):
    """Requests (prompt, params, step to arrive at) through eng → (per request: tokens, sampled logprobs as
    (id, logprob, top ids), prompt logprobs; the piecewise steps as (real tokens, bucket); core breaks run)."""
    steps, breaks = [], []
    graphs = eng.runner.prefill_graphs
    if graphs is not None:
        run = graphs.run

        def counted(view, ids):
            h = run(view, ids)
            steps.append((len(ids), h.shape[0]))
            return h
        graphs.run = counted
        split = pg.PrefillGraph.split

        def counted_split(self, *a):
            breaks.append(self.tokens)
            return split(self, *a)
        pg.PrefillGraph.split = counted_split
    ids, recs, step = [None] * len(requests), {}, 0
    try:
        while step == 0 or eng.has_unfinished() or any(i is None for i in ids):
            for k, (p, params, at) in enumerate(requests):
                if at == step:
                    ids[k] = eng.add_request(p, params)
            for o in eng.step():
                rec = recs.setdefault(o.request_id, {"ids": [], "lp": [], "prompt": None})
                rec["ids"] += o.new_token_ids
                rec["lp"] += [(x.token_id, x.logprob, list(x.top)) for x in o.new_logprobs]
                if o.prompt_logprobs is not None:
                    rec["prompt"] = o.prompt_logprobs
            step += 1
            assert step < 500
    finally:
        if graphs is not None:
            pg.PrefillGraph.split = split
    assert_pool_empty(eng)
    return [recs[i] for i in ids], steps, breaks


def assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a["ids"] == b["ids"]
    assert len(a["lp"]) == len(b["lp"])
    for x, y in zip(a["lp"], b["lp"]):
        assert x[0] == y[0] and x[1] == pytest.approx(y[1], abs=tol)
        assert_same_top(dict(x[2]), dict(y[2]), tol)
    assert (a["prompt"] is None) == (b["prompt"] is None)
    if a["prompt"] is not None:
        assert len(a["prompt"]) == len(b["prompt"])
        for x, y in zip(a["prompt"][1:], b["prompt"][1:]):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=tol)


def assert_same_until_a_tie(a: dict, b: dict, tol: float) -> None:
    """Greedy runs of two paths that round differently (bf16): as assert_same up to the first token where they part,
    and there the two picks must tie within tol in both runs' top logprobs (rounding may break a near-tie either
    way); past it each continues from another text, so only the lengths are compared."""
    assert len(a["ids"]) == len(b["ids"])
    n = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), len(a["ids"]))
    if n < len(a["ids"]):
        for run, mine, other in ((a, a["ids"][n], b["ids"][n]), (b, b["ids"][n], a["ids"][n])):
            top = dict(run["lp"][n][2])
            assert other in top and top[mine] - top[other] <= tol, (n, run["lp"][n])
    assert_same({**a, "ids": a["ids"][:n], "lp": a["lp"][:n]}, {**b, "ids": b["ids"][:n], "lp": b["lp"][:n]}, tol)


def assert_same_top(a: dict, b: dict, tol: float) -> None:
    """Top logprobs {id: logprob} alike: the same ids with logprobs within tol, except where the last places tie
    within tol (bf16 logits tie often: which of the tied ids is listed is arbitrary)."""
    assert len(a) == len(b)
    for x, y in ((a, b), (b, a)):
        floor = min(y.values(), default=0.0)
        for t, lp in x.items():
            assert lp == pytest.approx(y[t], abs=tol) if t in y else lp == pytest.approx(floor, abs=tol), (a, b)


ARRIVALS = [(prompt(1, 5), SamplingParams(max_tokens=12, logprobs=2, **GREEDY), 0),
            (prompt(2, 19), SamplingParams(max_tokens=9, **GREEDY), 0),
            (prompt(3, 30), SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=2, **GREEDY), 3),
            (prompt(4, 3), SamplingParams(max_tokens=1, **GREEDY), 5),
            (prompt(5, 40), SamplingParams(max_tokens=7, temperature=0.9, top_p=0.95, seed=3, logprobs=1), 6)]


def test_token_buckets():
    assert pg.token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1280, 1536, 1792, 2048]
    big = pg.token_buckets(8192)
    assert big[7:] == [1280, 1536, 1792, 2048, 2560, 3072, 3840, 4608, 5632, 6912, 8192]  # + a quarter, to 256s
    assert all(b / a <= 1.25 for a, b in zip(big[6:], big[7:]))  # past the doublings a step pads at most 25%
    assert pg.token_buckets(1100) == [16, 32, 64, 128, 256, 512, 1024, 1100]
    assert pg.token_buckets(100) == [16, 32, 64, 100]
    assert pg.token_buckets(16) == [16] and pg.token_buckets(5) == [5]


def breaks_per_step(model, static: bool) -> int:
    """One break per mixer core; with the static KDA layout, MLA's only."""
    return len(model.config.linear_attn_config.full_attn_layers) if static else model.config.num_hidden_layers


@pytest.mark.parametrize("split,decode_graphs,static", [(True, True, False), (False, True, False),
                                                        (False, False, False), (True, True, True),
                                                        (False, False, True)])
def test_pieces_equal_plain_engine_and_generate(model, split, decode_graphs, static):
    """Requests arriving while others decode (chunks of several prompts in one step, split or unsplit mixed
    steps, decode-only steps through the pieces when decode graphs are off, a prompt scored, seeded sampling):
    outputs equal the plain engine's, greedy tokens equal generate's, steps ran padded, one break per core (per
    MLA core with the KDA cores over the bucket's fixed-shape layout: its one-token rows run the chunked form)."""
    cfg = dict(split_mixed_steps=split, decode_graphs=decode_graphs)
    got, steps, breaks = drive(make(model, True, static_kda_cores=static, **cfg), ARRIVALS)
    want, none, _ = drive(make(model, False, **cfg), ARRIVALS)
    assert none == [] and len(steps) >= 4, steps
    assert any(n < bucket for n, bucket in steps) and any(n > 16 for n, _ in steps), steps
    assert len(breaks) == len(steps) * breaks_per_step(model, static)
    for (p, params, _), a, b in zip(ARRIVALS, got, want):
        assert_same(a, b)
        if params.temperature == 0:
            assert a["ids"] == reference(model, p, params.max_tokens)


@pytest.mark.parametrize("static", [False, True])
def test_pieces_under_preemption_and_prefix_hits(model, static):
    """A pool too small for every sequence (preemption by swap, chunks resumed), then a follow-up prompt that
    hits the first run's prefix units and KDA checkpoints: still generate's tokens through the pieces."""
    prompts = [prompt(40 + i, 18) for i in range(3)]
    eng = make(model, True, num_blocks=7, prefix_caching=False, static_kda_cores=static)
    got, steps, _ = drive(eng, [(p, SamplingParams(max_tokens=20, **GREEDY), 0) for p in prompts])
    assert eng.scheduler.num_preemptions > 0 and steps
    for p, r in zip(prompts, got):
        assert r["ids"] == reference(model, p, 20)
    eng = make(model, True, static_kda_cores=static)
    p = prompt(90, 10)
    first, _, _ = drive(eng, [(p, SamplingParams(max_tokens=13, **GREEDY), 0)])
    follow = p + first[0]["ids"] + prompt(91, 3)
    out = eng.generate([follow], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.cache.restored_tokens >= 20, out.cache
    assert list(out.output_ids) == reference(model, follow, 6)


@pytest.mark.parametrize("static", [False, True])
def test_pad_rows_never_reach_real_rows(model, monkeypatch, static):
    """The attack: every pad row of every step holds a different random token (and so routes to other experts
    and carries other values through every per-token part; with the static KDA layout, through the pad document's
    KDA and the scratch slot's state, which is also filled with large random values before every step). The real
    rows' outputs do not move."""
    calm, steps, _ = drive(make(model, True, static_kda_cores=static), ARRIVALS)
    load = pg.PrefillGraph.load
    gen = torch.Generator().manual_seed(7)

    def hostile_load(self, ids):
        load(self, ids)
        pad = torch.randint(0, model.config.vocab_size, (self.tokens - len(ids),), generator=gen)
        self.ids[len(ids):] = pad
        if static:
            pool = eng.pool
            for layer, state in pool.state.items():
                state[pool.scratch_slot] = 100 * torch.randn(state[0].shape, generator=gen)
                pool.conv[layer][pool.scratch_slot] = 100 * torch.randn(pool.conv[layer][0].shape, generator=gen)
    monkeypatch.setattr(pg.PrefillGraph, "load", hostile_load)
    eng = make(model, True, static_kda_cores=static)
    hostile, steps2, _ = drive(eng, ARRIVALS)
    assert steps2 == steps and sum(b - n for n, b in steps) > 20
    for a, b in zip(hostile, calm):
        assert_same(a, b)


def test_static_kda_layout_pads_the_documents_and_the_chunk_plan(model):
    """StaticKDAView.load: the step's documents first, then one over the pad rows, then empty ones; fla's chunk plan
    of the real documents as `chunk_plan` makes it, padded with fla's graph-mode sentinel rows (document −1); slots past
    the step's rows are the scratch slot; too many rows or tokens are refused."""
    from k3.ops.kda_fla_lean import chunk_plan
    from k3.serve.runner import StaticKDAView

    eng = make(model, True, static_kda_cores=True)
    view = StaticKDAView(eng.pool, model.config.num_hidden_layers, 256, 4)
    lens, slots = [70, 1, 64], [5, 2, 9]
    view.load(lens, slots)
    S, scratch = 6, eng.pool.scratch_slot
    assert view.cu_cpu.tolist() == view.cu_seqlens.tolist() == [0, 70, 71, 135, 256, 256, 256]
    assert view.slots.tolist() == [5, 2, 9, scratch, scratch, scratch]
    assert view.kda_rows.item() == 4  # the rows whose states move: the step's and the pad document's
    real = chunk_plan(torch.tensor([0, 70, 71, 135]))
    n = real.chunk_indices.shape[0]  # 2 + 1 + 1 chunks
    pad_doc = [[3, i] for i in range(2)]  # 121 pad tokens: 2 chunks
    assert view.prefill_plan.chunk_indices[:n].tolist() == real.chunk_indices.tolist()
    assert view.prefill_plan.chunk_indices[n:n + 2].tolist() == pad_doc
    assert view.prefill_plan.chunk_indices.shape[0] == 256 // 64 + S
    assert (view.prefill_plan.chunk_indices[n + 2:] == torch.tensor([-1, 0])).all() and view.prefill_plan.graph
    assert view.prefill_plan.chunk_offsets.tolist() == [0, 2, 3, 4, 6, 6, 6]
    with pytest.raises(ValueError, match="do not fit"):
        view.load([1] * 5, list(range(5)))
    with pytest.raises(ValueError, match="do not fit"):
        view.load([200, 57], [1, 2])
    small = StaticKDAView(eng.pool, model.config.num_hidden_layers, 3, 4)  # 3 tokens hold 3 rows at most
    assert small.S == 5 and small.slots.shape == (5,)
    small.load([1, 1, 1], [5, 2, 9])
    assert small.cu_cpu.tolist() == [0, 1, 2, 3, 3, 3] and small.kda_rows.item() == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("static", [False, True])
def test_cuda_pieces_replay_equal_plain_engine(model, static, caplog):
    """On CUDA each bucket is captured after its first (eager) step as num_layers + 1 graphs with the cores
    between them, and later steps of that bucket replay them: fp32 tokens equal the plain engine's and generate's,
    split and unsplit. An fp32 model's KDA core is the reference, which plans on the host, so the static KDA layout
    is refused with one warning (a graph of it would keep the capture's documents) and the cores break the chain."""
    cuda = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cuda.load_state_dict(model.state_dict())
    greedy = [(p, SamplingParams(max_tokens=params.max_tokens, **GREEDY), at) for p, params, at in ARRIVALS]
    for split in (True, False):
        eng = make(cuda, True, split_mixed_steps=split, static_kda_cores=static)
        assert ("graph chunk plan" in caplog.text) == static
        with torch.inference_mode():
            got, steps, _ = drive(eng, greedy)
            want, _, _ = drive(make(cuda, False, split_mixed_steps=split), greedy)
        entries = eng.runner.prefill_graphs.entries
        assert entries and all(len(g.pieces) == breaks_per_step(cuda, False) + 1 for g in entries.values())
        assert len(steps) > len(entries)  # some steps replayed a captured bucket
        for (p, params, _), a, b in zip(greedy, got, want):
            assert a["ids"] == b["ids"] == reference(model, p, params.max_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [True, False])
def test_cuda_static_kda_cores_replay_equal_the_breaking_pieces(model, split):
    """bf16, where fla's lean chunked core runs: with the static KDA layout each bucket is captured as MLA layers
    + 1 pieces, the KDA cores inside them, and its later steps replay them over the layout refilled in place (other
    rows, lengths and slots than the capture's; then prompts that hit the first ones' prefix units and KDA
    checkpoints): tokens, sampled and prompt logprobs equal those of the pieces that break at every core (the
    logprobs within 0.1: the two paths' kernels tile the KDA cores differently, a decode row beside prompt rows
    runs the chunked form rather than the recurrent one, and bf16 logits of magnitude 2-4 differ by a few of their
    ulps of 1/64; so a greedy run may part from the other at a near-tie, and is compared up to there. A layout the
    replay did not refill parts at once, with no tie)."""
    cuda = K3ForCausalLM(K3Config.preset("tiny")).eval()
    cuda.load_state_dict(model.state_dict())
    cuda = cuda.cuda().bfloat16()
    greedy = [(p, SamplingParams(max_tokens=params.max_tokens, logprobs=4, prompt_logprobs=params.prompt_logprobs,
                                 **GREEDY), at) for p, params, at in ARRIVALS]
    again = greedy + [(p + prompt(60 + i, 9), params, 12 + i) for i, (p, params, _) in enumerate(greedy)]
    runs = []
    for static in (True, False):
        eng = make(cuda, True, split_mixed_steps=split, static_kda_cores=static)
        with torch.inference_mode():
            runs.append(drive(eng, again))
        entries = eng.runner.prefill_graphs.entries
        assert entries and all(len(g.pieces) == breaks_per_step(cuda, static) + 1 for g in entries.values())
        assert len(runs[-1][1]) > 2 * len(entries)  # most steps replayed a captured bucket
    (got, steps, _), (want, steps_want, _) = runs
    assert steps == steps_want
    parted = 0
    for a, b in zip(got, want):
        assert_same_until_a_tie(a, b, tol=0.1)
        parted += a["ids"] != b["ids"]
    assert parted <= len(again) // 4, parted  # near-ties are rare: most runs agree to the end


def test_the_default_is_on_where_decode_graphs_run_and_off_on_a_cpu(model, caplog):
    """EngineConfig.prefill_graphs None: the pieces on CUDA (a model graphs allow), none on a CPU (where they would
    only pad each step to its bucket). static_kda_cores None: the fixed-shape KDA layout where the cores take a
    graph plan (a bf16 model on CUDA), silently without it elsewhere (an fp32 model's reference core; a CPU)."""
    cfg = dict(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=24, max_num_seqs=8)
    assert EngineConfig().prefill_graphs is None and EngineConfig().static_kda_cores is None
    assert LLMEngine(model, None, EngineConfig(**cfg)).runner.prefill_graphs is None
    assert LLMEngine(model, None, EngineConfig(**cfg, prefill_graphs=True)).runner.prefill_graphs.kda_view is None
    asked = LLMEngine(model, None, EngineConfig(**cfg, prefill_graphs=True, static_kda_cores=True))
    assert asked.runner.prefill_graphs.kda_view is not None  # on a CPU only when asked (eagerly, for tests)
    if torch.cuda.is_available():
        cuda = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
        assert LLMEngine(cuda, None, EngineConfig(**cfg)).runner.prefill_graphs.kda_view is None  # fp32
        assert LLMEngine(cuda, None, EngineConfig(**cfg, prefill_graphs=False)).runner.prefill_graphs is None
        bf16 = LLMEngine(cuda.bfloat16(), None, EngineConfig(**cfg)).runner.prefill_graphs
        assert bf16 is not None and bf16.kda_view is not None
        assert LLMEngine(cuda, None, EngineConfig(**cfg, static_kda_cores=False)).runner.prefill_graphs.kda_view is None
        assert "graph chunk plan" not in caplog.text  # the default falls back without a warning


def test_cli_flag_reaches_the_engine_and_distributed_serving_refuses_it():
    """`--prefill-graphs` sets EngineConfig.prefill_graphs for `k3 serve` and `k3 bench serve`; serving over
    several ranks refuses it by name before starting any rank (its pieces would capture collectives)."""
    from k3.cli import _engine_config, build_parser
    from k3.serve.distributed import serve_from_cli
    for argv in (["serve", "--model", "m"], ["bench", "serve"]):
        assert _engine_config(build_parser().parse_args(argv)).prefill_graphs is None  # the engine's default
        assert _engine_config(build_parser().parse_args(argv + ["--prefill-graphs"])).prefill_graphs is True
        assert _engine_config(build_parser().parse_args(argv + ["--no-prefill-graphs"])).prefill_graphs is False
        assert _engine_config(build_parser().parse_args(argv)).static_kda_cores is None  # where the cores allow
        assert _engine_config(build_parser().parse_args(argv + ["--no-static-kda-cores"])).static_kda_cores is False
        assert _engine_config(build_parser().parse_args(argv + ["--static-kda-cores"])).static_kda_cores is True
    a = build_parser().parse_args(["serve", "--model", "m", "--nproc", "2", "--prefill-graphs"])
    with pytest.raises(ValueError, match="--prefill-graphs"):
        serve_from_cli(a, _engine_config(a), None)


def test_a_failed_capture_leaves_its_bucket_eager_and_the_outputs_right(model, monkeypatch, caplog):
    """A capture that raises (an op a capture refuses) costs nothing but speed: the step's eager pass already ran,
    one warning names the bucket and the error, later steps of that bucket run eagerly, outputs stay right.
    (CUDA's streams are stood in for on the CPU; the capture itself is what fails.)"""
    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    tries = []

    def refused(self, mempool):
        tries.append(self.tokens)
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(pg.PrefillGraph, "capture", refused)
    eng = make(model, True)
    eng.runner.prefill_graphs.capture = True
    with caplog.at_level("WARNING", logger="k3.serve.prefill_graphs"):
        got, steps, _ = drive(eng, ARRIVALS)
    assert sorted(tries) == sorted(set(b for _, b in steps)) and len(steps) > len(tries)  # one try a bucket
    assert all(not g.pieces for g in eng.runner.prefill_graphs.entries.values())
    warned = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == len(tries) and "operation not permitted" in warned[0]
    want, _, _ = drive(make(model, False), ARRIVALS)
    for a, b in zip(got, want):
        assert_same(a, b)


@pytest.mark.parametrize("split", [False, True])
def test_a_step_through_the_pieces_reads_the_device_once(model, monkeypatch, split):
    """The pieces add no wait for the device: the padded ids go up pinned and non-blocking, every core takes its
    shapes from the host layout, so a step's one read is still read_back's (spied as in test_serve_host_syncs)."""
    from collections import Counter

    from test_serve_host_syncs import SyncSpy
    eng = make(model, True, split_mixed_steps=split, max_batch_tokens=10)
    for i in range(3):
        eng.add_request(prompt(60 + i, 5 + 4 * i), SamplingParams(max_tokens=8, logprobs=1, **GREEDY))
    runs = []
    run = eng.runner.prefill_graphs.run
    eng.runner.prefill_graphs.run = lambda view, ids: runs.append(len(ids)) or run(view, ids)
    spy = SyncSpy(monkeypatch)
    for step in range(10):
        if step == 3:
            eng.add_request(prompt(70, 17), SamplingParams(max_tokens=3, **GREEDY))
        outs, waits = spy.step(eng)
        assert waits == Counter({("serve/sampling.py", "read_back", "tolist"): bool(outs)}), (step, waits)
    assert len(runs) >= 4, runs


@pytest.mark.parametrize("pieces", [False, True])
def test_each_kda_layer_gathers_its_state_once_a_step(model, monkeypatch, pieces):
    """A KDA layer's short convs and its core both read the sequences' state rows (the view keeps the first
    read until the layer writes back): one gather of the pool's state per KDA layer in an eager step (a prefill
    step and a mixed one, plain and through the pieces)."""
    eng = make(model, pieces, decode_graphs=False, prefix_caching=False)  # (no checkpoint copies: they gather too)
    import k3.serve.runner as runner_mod
    states = {t.data_ptr() for t in eng.pool.state.values()}
    gathers = []
    gather = runner_mod.gather_slots

    def counted(pool, slots, count=None):  # the view's gathers, through the kernels or the reference
        if pool.data_ptr() in states:
            gathers.append(slots.numel())
        return gather(pool, slots, count)
    monkeypatch.setattr(runner_mod, "gather_slots", counted)
    kda_layers = sum(not model.config.is_mla(l) for l in range(model.config.num_hidden_layers))
    eng.add_request(prompt(80, 9), SamplingParams(max_tokens=4, **GREEDY))
    for step in range(3):  # the prefill, then decodes beside a new prompt's chunk
        if step == 1:
            eng.add_request(prompt(81, 7), SamplingParams(max_tokens=2, **GREEDY))
        gathers.clear()
        with torch.inference_mode():
            eng.step()
        assert len(gathers) == kda_layers, (step, gathers)


def test_gc_paused_holds_the_collector_off_and_restores_it():
    """Captures run with the cyclic collector off (it could free another graph mid-capture); it comes back after,
    also when the capture raises, and stays off where the caller had it off."""
    import gc
    assert gc.isenabled()
    with pg.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), pg.gc_paused():
        raise ValueError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with pg.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
