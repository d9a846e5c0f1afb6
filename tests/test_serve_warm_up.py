"""`LLMEngine.warm_up`: every graph the engine replays is made before the first request (on CUDA each is a capture
that would otherwise land inside a request's latency). On a CPU, with graphs forced on, the same keyed steps run
eagerly: the warm-up must make every key a load within its length uses, leave no trace a request could see (the
decode graphs' warm-up steps run pad rows only, over the scratch slot and block), and stay out of the metrics.
Also `StepLog`, the per-step trace `k3 bench serve` reports from."""
import math

import pytest

from k3.serve import SamplingParams
from k3.serve.metrics import StepLog
from test_serve_engine import GREEDY, assert_pool_empty, engine, model, prompt, reference  # noqa: F401


def keys(eng) -> set:
    r = eng.runner
    return set(r.graphs.entries) | {("prefill", b) for b in r.prefill_graphs.entries}


def test_warm_up_makes_every_key_and_leaves_no_trace(model):
    eng = engine(model, decode_graphs=True, prefill_graphs=True, max_batch_tokens=32, max_num_seqs=4)
    made = eng.warm_up(max_len=64)  # 64 tokens = 4 blocks of 16: widths 1, 2, 4; rows 1, 2, 4; buckets 16, 32
    assert keys(eng) == {(r, w) for r in (1, 2, 4) for w in (1, 2, 4)} | {("prefill", 16), ("prefill", 32)}
    assert made == 11
    assert eng.warm_up(max_len=64) == 0  # nothing left to make
    assert_pool_empty(eng)
    assert eng.metrics.prompt_tokens == 0 and eng.metrics.generation_tokens == 0  # the warm-up is not a request
    # ragged lengths, up to 4 running, contexts crossing block edges up to 64 tokens: no new key, exact tokens
    lens, max_tokens = [3, 20, 41, 9, 30], [20, 7, 23, 12, 16]
    prompts = [prompt(300 + i, n) for i, n in enumerate(lens)]
    before = keys(eng)
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens[0], **GREEDY))
    assert keys(eng) == before
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference(model, p, max_tokens[0])
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts, max_tokens)]
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o.output_ids) for o in eng.step() if o.finished)
    assert keys(eng) == before
    for rid, p, n in zip(ids, prompts, max_tokens):
        assert final[rid] == reference(model, p, n)
    assert eng.metrics.prompt_tokens == 2 * sum(lens)  # the two loads' prompts, none of the warm-up's
    assert_pool_empty(eng)


def test_warm_up_caps_widths_at_max_model_len_and_refuses_a_busy_engine(model):
    eng = engine(model, decode_graphs=True, max_num_seqs=2, max_model_len=40)  # 40 tokens: 3 blocks → width 4
    assert eng.warm_up(max_len=10_000) == 2 * 3  # rows 1, 2 × widths 1, 2, 4
    assert set(eng.runner.graphs.entries) == {(r, w) for r in (1, 2) for w in (1, 2, 4)}
    eng.add_request(prompt(5, 6), SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.warm_up()
    while eng.has_unfinished():
        eng.step()
    assert_pool_empty(eng)


def test_warm_up_without_graphs_makes_nothing(model):
    eng = engine(model)  # a CPU engine: no graphs by default
    assert eng.runner.graphs is None and eng.runner.prefill_graphs is None
    assert eng.warm_up() == 0


def test_step_log_summary_splits_the_wall_time_and_the_step_kinds():
    class S:
        def __init__(self, prefill):
            self.in_prefill = prefill
    log = StepLog()
    # launches at 0, 10, 14, 18, 40 ms: a prompt step (2 prompt rows + 1 decode, 300 tokens), then decodes of 3 rows
    # (the last two launched while the step before them was on the device)
    log.launch(0.000, [S(True), S(True), S(False)], [200, 99, 1])
    for t in (0.010, 0.014, 0.018):
        log.launch(t, [S(False)] * 3, [1, 1, 1], overlapped=t > 0.012)
    log.launch(0.040, [S(False)] * 2, [1, 1])
    for a, b, c in ((0.0, 0.009, 0.010), (0.010, 0.013, 0.014), (0.014, 0.017, 0.018), (0.018, 0.019, 0.020)):
        log.iteration(a, b, c, intake=0.0005)
    out = StepLog.summary(log, wall=0.050)
    assert out["iterations"] == 4
    assert out["step_s"] == pytest.approx(0.009 + 0.003 + 0.003 + 0.001)
    assert out["emit_s"] == pytest.approx(0.004) and out["intake_s"] == pytest.approx(0.002)
    assert out["idle_s"] == pytest.approx(0.050 - 0.002 - 0.016 - 0.004)
    assert out["prompt"] == pytest.approx({"steps": 1, "rows": 3, "tokens": 300, "period_ms": 10.0, "overlapped": 0})
    # decode periods: 4, 4, 22 ms (the last launch has no successor and is not counted)
    assert out["decode"] == pytest.approx({"steps": 3, "rows": 3, "tokens": 3, "period_ms": 10.0, "overlapped": 2})
    assert [round(x["ms"]) for x in out["slowest"]] == [22, 10, 4, 4]
    assert out["slowest"][1]["prompt_rows"] == 2


def test_step_log_cuts_the_iterations_to_the_timed_window():
    """Given the run's start, an iteration under way before it (a warm-up's last, still emitting) or after its end
    (the last one still handing over after the client had its final token) counts only within the window, so the
    phases cannot add up past the wall and idle stays ≥ 0."""
    log = StepLog()
    log.iteration(0.90, 1.05, 1.06, intake=0.05)  # began 100 ms before the window, its intake before that
    log.iteration(1.10, 1.20, 1.30, intake=0.02)
    log.iteration(1.33, 1.36, 1.45, intake=0.04)  # its intake began before 1.30, its emission ends past 1.40
    out = log.summary(wall=0.40, start=1.0)
    assert out["step_s"] == pytest.approx(0.05 + 0.10 + 0.03) and out["emit_s"] == pytest.approx(0.01 + 0.10 + 0.04)
    assert out["intake_s"] == pytest.approx(0.02 + 0.04)
    assert out["idle_s"] == pytest.approx(0.40 - 0.18 - 0.15 - 0.06) and out["idle_s"] >= 0
    uncut = log.summary(wall=0.40)  # (without the start: as logged)
    assert uncut["step_s"] == pytest.approx(0.15 + 0.10 + 0.03) and uncut["emit_s"] == pytest.approx(0.20)


def test_step_log_gives_the_engine_side_phases_of_the_requests_over_its_trace():
    """With the engine's Metrics, the summary's `engine_ms` are the means of the requests' TTFT, queue and prefill
    times observed during the trace only (those before it do not count); none observed: nan."""
    from k3.serve.metrics import Metrics
    m = Metrics()
    m.on_token(True, 5.0)  # before the trace
    log = StepLog(m)
    assert all(math.isnan(v) for v in log.summary(1.0)["engine_ms"].values())
    m.on_token(True, 0.010)
    m.on_token(True, 0.030)
    m.on_token(False, 9.0)  # an inter-token latency: not a first token
    out = log.summary(1.0)["engine_ms"]
    assert out["ttft"] == pytest.approx(20.0) and math.isnan(out["queue"])
