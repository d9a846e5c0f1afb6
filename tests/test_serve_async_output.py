"""Async output processing (EngineConfig.async_output): a decode step launches while the previous one is still
unread, feeding its picked ids from the device, and the previous step finishes after. On a CPU the read-back
happens at once, but the order of launches and finishes is the GPU's, so every output must equal the synchronous
engine's: tokens, logprobs, text, finish reasons, stop strings hit mid-stream, aborts with a step in flight,
max_tokens, preemption, prefix hits afterwards, seeded sampling with penalties and min_tokens."""
import pytest
import torch

from k3.data import Tokenizer
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from test_serve_engine import GREEDY, assert_pool_empty, model, prompt, reference  # noqa: F401


def make(model, async_output: bool, tokenizer=None, **kw) -> LLMEngine:
    cfg = dict(memory_bytes=16 << 20, block_size=16, match_unit=4, max_batch_tokens=64, max_num_seqs=8,
               async_output=async_output)
    cfg.update(kw)
    return LLMEngine(model, tokenizer, EngineConfig(**cfg))


def drive(eng: LLMEngine, requests, abort_at: dict | None = None):
    """Requests (prompt, params, step to arrive at) through eng, stepping until done → (per request: the record
    of its outputs, in request order; how many steps launched with their input ids on the device).
    abort_at: {step: request index} aborted before that step runs."""
    overlapped = []
    eng.launches = []  # per step: (launched with device ids, with prompt rows)
    run = eng.runner.run

    def counting_run(seqs, lens, sample_rows, ids=None):
        overlapped.append(ids is not None)
        eng.launches.append((ids is not None, any(s.in_prefill for s in seqs)))
        return run(seqs, lens, sample_rows, ids)
    eng.runner.run = counting_run
    ids, recs, step = [None] * len(requests), {}, 0
    while step == 0 or eng.has_unfinished() or any(i is None for i in ids):
        for k, (p, params, at) in enumerate(requests):
            if at == step:
                ids[k] = eng.add_request(p, params)
        if abort_at and step in abort_at:
            assert eng.abort(ids[abort_at[step]])
        for o in eng.step():
            rec = recs.setdefault(o.request_id, {"ids": [], "lp": [], "text": "", "reason": None, "outputs": 0,
                                                 "prompt": None})
            assert rec["reason"] is None, "an output after the request finished"
            if o.prompt_logprobs is not None:
                rec["prompt"] = [(x.token_id, x.logprob, x.top) for x in o.prompt_logprobs[1:]]
            rec["ids"] += o.new_token_ids
            rec["lp"] += [(x.token_id, x.logprob, x.top) for x in o.new_logprobs]
            rec["text"] += o.new_text
            rec["outputs"] += 1
            if o.finished:
                rec["reason"] = o.finish_reason
                assert list(o.output_ids) == rec["ids"] and o.text == rec["text"]
        step += 1
        assert step < 500
    assert_pool_empty(eng)
    assert eng.in_flight is None
    return [recs.get(i) for i in ids], sum(overlapped)


MIXED_ARRIVALS = [(prompt(1, 5), SamplingParams(max_tokens=14, logprobs=2, **GREEDY), 0),
                  (prompt(2, 9), SamplingParams(max_tokens=11, **GREEDY), 0),
                  (prompt(3, 23), SamplingParams(max_tokens=6, logprobs=0, **GREEDY), 4),
                  (prompt(4, 3), SamplingParams(max_tokens=1, **GREEDY), 7),
                  (prompt(5, 12), SamplingParams(max_tokens=9, **GREEDY), 9)]


@pytest.mark.parametrize("graphs", [False, True])
def test_async_equals_sync_and_one_shot_generate(model, graphs):
    """Greedy requests arriving while others decode (prefill chunks, mixed steps, a one-token request): async ==
    sync in tokens and logprobs, both equal generate, and most decode steps did overlap."""
    cfg = dict(decode_graphs=graphs, max_batch_tokens=10, match_unit=16)
    sync, n_sync = drive(make(model, False, **cfg), MIXED_ARRIVALS)
    asyn, n_async = drive(make(model, True, **cfg), MIXED_ARRIVALS)
    assert n_sync == 0 and n_async >= 5, n_async
    for (p, params, _), a, b in zip(MIXED_ARRIVALS, asyn, sync):
        assert a["ids"] == b["ids"] == reference(model, p, params.max_tokens)
        assert a["reason"] == b["reason"] == "length"
        assert len(a["lp"]) == len(b["lp"]) == (params.max_tokens if params.logprobs is not None else 0)
        for x, y in zip(a["lp"], b["lp"]):
            assert x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-5)
            assert [t for t, _ in x[2]] == [t for t, _ in y[2]]


# one request every other step, as an HTTP load brings them: logprobs, a scored prompt, seeded sampling
STAGGERED = [(prompt(100 + i, 5 + 4 * i), SamplingParams(max_tokens=9 - i % 3, logprobs=i % 2 or None,
                                                          prompt_logprobs=2 if i == 3 else None, **GREEDY), 2 * i)
             for i in range(6)] + [(prompt(110, 7), SamplingParams(max_tokens=8, temperature=0.8, seed=4), 5)]


@pytest.mark.parametrize("graphs", [False, True])
def test_arrivals_and_prompt_chunks_launch_beside_in_flight_decodes(model, graphs):
    """Requests arriving one by one while others decode: with the split decode graphs, each admission and prompt
    chunk launches beside the in-flight decodes (their ids from the device) instead of draining the device's
    queue; without them the step drains. Either way async == sync: tokens, logprobs, prompt logprobs, seeded
    sampling; greedy tokens equal generate's."""
    cfg = dict(decode_graphs=graphs, max_batch_tokens=12, match_unit=4)
    sync, _ = drive(make(model, False, **cfg), STAGGERED)
    eng = make(model, True, **cfg)
    asyn, _ = drive(eng, STAGGERED)
    mixed = sum(fed and prefill for fed, prefill in eng.launches)
    drained = sum(not fed for fed, _ in eng.launches[1:])
    if graphs:
        assert mixed >= len(STAGGERED) - 1 and drained <= 2, eng.launches
    else:
        assert mixed == 0 and drained >= len(STAGGERED) - 1, eng.launches
    for (p, params, _), a, b in zip(STAGGERED, asyn, sync):
        assert (a["ids"], a["reason"], a["outputs"]) == (b["ids"], b["reason"], b["outputs"])
        if params.temperature == 0:
            assert a["ids"] == reference(model, p, params.max_tokens)
        assert [x[0] for x in a["lp"]] == [x[0] for x in b["lp"]]
        assert [x[1] for x in a["lp"]] == pytest.approx([x[1] for x in b["lp"]], abs=1e-5)
        assert (a["prompt"] is None) == (b["prompt"] is None) == (params.prompt_logprobs is None)
        if a["prompt"] is not None:
            assert [x[0] for x in a["prompt"]] == [x[0] for x in b["prompt"]] == p[1:]
            assert [x[1] for x in a["prompt"]] == pytest.approx([x[1] for x in b["prompt"]], abs=1e-5)


def test_device_ids_beside_prompt_chunks_need_the_split_decode_graphs(model):
    """The runner refuses a mixed step with device ids where no decode graph reads them (the chunks' rows would
    take host tokens the host does not have), and ids that do not match the step's decodes."""
    eng = make(model, True, decode_graphs=False)
    eng.add_request(prompt(120, 5), SamplingParams(max_tokens=4, **GREEDY))
    while eng.in_flight is None:  # the prompt (chunked at its match boundary), then its token in flight
        eng.step()
    seq, = eng.scheduler.running
    eng.add_request(prompt(121, 6), SamplingParams(max_tokens=4, **GREEDY))
    assert eng.scheduler.schedule_in_flight(eng._may_feed_in_flight, eng._ends_in_flight, admit=False) is None
    new = eng.scheduler.waiting[0]
    eng.pool.admit(new, 0)
    ids = eng.in_flight.sample.picked
    with pytest.raises(ValueError, match="split decode graphs"):
        eng.runner.run([seq, new], [1, 6], [0, 1], ids)
    with pytest.raises(ValueError, match="one per decoding row"):
        eng.runner.run([seq, new], [1, 6], [0, 1], torch.cat([ids, ids]))
    with pytest.raises(ValueError, match="one per decoding row"):  # prompt chunks only: no ids to feed
        eng.runner.run([new], [6], [0], ids[:0])


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_max_tokens_is_never_exceeded_by_an_in_flight_token(model, max_tokens):
    """A sequence whose in-flight token is its last is not scheduled again: exactly max_tokens tokens, one
    output per token, none after the finish."""
    reqs = [(prompt(20, 6), SamplingParams(max_tokens=max_tokens, **GREEDY), 0),
            (prompt(21, 4), SamplingParams(max_tokens=max_tokens + 3, **GREEDY), 0)]
    got, _ = drive(make(model, True, match_unit=16), reqs)
    for (p, params, _), r in zip(reqs, got):
        assert r["ids"] == reference(model, p, params.max_tokens)
        assert r["outputs"] == params.max_tokens and r["reason"] == "length"


def test_seeded_sampling_penalties_and_min_tokens_equal_sync(model):
    """Seeded top-p/top-k rows, penalties (counted on the device, so the overlapped step sees the in-flight
    token) and min_tokens banning a stop id (counting the in-flight token): async == sync."""
    ref = reference(model, prompt(31, 7), 12)
    reqs = [(prompt(30, 8), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=5,
                                           logprobs=2), 0),
            (prompt(31, 7), SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3,
                                           frequency_penalty=0.7, presence_penalty=0.4), 0),
            (prompt(31, 7), SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[ref[2]], **GREEDY), 2),
            (prompt(32, 5), SamplingParams(max_tokens=10, temperature=1.0, min_p=0.05, seed=9), 3)]
    sync, _ = drive(make(model, False), reqs)
    asyn, n = drive(make(model, True), reqs)
    assert n > 0
    for a, b in zip(asyn, sync):
        assert a["ids"] == b["ids"] and a["reason"] == b["reason"]
        assert [x[0] for x in a["lp"]] == [x[0] for x in b["lp"]]
        assert [x[1] for x in a["lp"]] == pytest.approx([x[1] for x in b["lp"]], abs=1e-5)
    assert len(asyn[2]["ids"]) >= 6  # min_tokens held the stop id back


def test_stop_token_and_stop_string_mid_stream_drop_the_wasted_row(model):
    """A stop token and a stop string hit while the next step is already launched: the overlapped row's token
    is dropped (no output after the finish), text and reasons equal sync, the pool empties."""
    tok = Tokenizer.from_file()
    p, q = prompt(70, 10), prompt(71, 8)
    ref = reference(model, p, 12)
    full_text = tok.decode(ref, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    reqs = [(p, SamplingParams(max_tokens=12, stop_token_ids=[ref[5]], **GREEDY), 0),
            (p, SamplingParams(max_tokens=12, stop=[stop], **GREEDY), 0),
            (q, SamplingParams(max_tokens=15, ignore_eos=True, **GREEDY), 0)]
    sync, _ = drive(make(model, False, tok, match_unit=16), reqs)
    asyn, n = drive(make(model, True, tok, match_unit=16), reqs)
    assert n >= 5
    assert asyn[0]["ids"] == ref[:6] and asyn[0]["reason"] == "stop"
    assert asyn[1]["reason"] == "stop" and asyn[1]["text"] == full_text[:full_text.index(stop)]
    for a, b in zip(asyn, sync):
        assert (a["ids"], a["text"], a["reason"], a["outputs"]) == (b["ids"], b["text"], b["reason"], b["outputs"])


def test_abort_with_a_step_in_flight(model):
    """Aborting a request whose token is on the device: its pending token never comes out, its slot and blocks
    are free, and its batch mates' tokens are unchanged."""
    reqs = [(prompt(80, 9), SamplingParams(max_tokens=20, **GREEDY), 0),
            (prompt(81, 6), SamplingParams(max_tokens=12, **GREEDY), 0)]
    eng = make(model, True, match_unit=16)
    got, n = drive(eng, reqs, abort_at={5: 0})
    assert n > 0
    assert got[0] is not None and got[0]["reason"] is None and 0 < len(got[0]["ids"]) < 20
    assert got[0]["ids"] == reference(model, reqs[0][0], len(got[0]["ids"]))
    assert got[1]["ids"] == reference(model, reqs[1][0], 12)


def test_abort_right_after_launch_leaves_nothing_in_flight_for_it(model):
    """The in-flight step holds the aborted sequence's row; finishing it must skip that row."""
    eng = make(model, True, match_unit=16)
    rid = eng.add_request(prompt(82, 5), SamplingParams(max_tokens=30, **GREEDY))
    eng.step(), eng.step(), eng.step()
    assert eng.in_flight is not None and [s.request_id for s in eng.in_flight.chosen] == [rid]
    assert eng.abort(rid)
    assert eng.has_unfinished() and eng.step() == []
    assert not eng.has_unfinished() and eng.in_flight is None
    assert_pool_empty(eng)


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_under_async_equals_uninterrupted(model, graphs):
    """A pool too small for every sequence: a step short of blocks (or with a swapped-out sequence next to come
    back) drains to the synchronous path, which preempts and swaps in; the tokens still equal generate's."""
    prompts = [prompt(40 + i, 18) for i in range(3)]
    eng = make(model, True, num_blocks=7, prefix_caching=False, decode_graphs=graphs)
    got, n = drive(eng, [(p, SamplingParams(max_tokens=20, **GREEDY), 0) for p in prompts])
    assert n > 0 and eng.scheduler.num_preemptions > 0
    assert eng.pool.stats["swaps_in"] == eng.pool.stats["swaps_out"] > 0
    for p, r in zip(prompts, got):
        assert r["ids"] == reference(model, p, 20)


def test_prefix_hits_after_an_async_run_equal_a_cold_run(model):
    """Units registered and checkpoints saved while decoding asynchronously are the right ones: a follow-up
    prompt (the first prompt + its output + more) hits them and still equals generate."""
    eng = make(model, True)
    p = prompt(90, 10)
    first, n = drive(eng, [(p, SamplingParams(max_tokens=13, **GREEDY), 0)])
    assert n > 0
    follow = p + first[0]["ids"] + prompt(91, 3)
    out = eng.generate([follow], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.cache.restored_tokens >= 20, out.cache
    assert list(out.output_ids) == reference(model, follow, 6)
    assert_pool_empty(eng)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_async_equals_sync(model):
    """On CUDA the overlapped step's ids reach the captured graph's input buffer by a device copy behind the
    host columns, and the previous step's read-back runs after the next launch: fp32 tokens equal the
    synchronous engine's and generate's (stop token included)."""
    from k3 import K3Config, K3ForCausalLM
    cuda = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cuda.load_state_dict(model.state_dict())
    ref = reference(model, prompt(1, 5), 14)
    reqs = MIXED_ARRIVALS + [(prompt(1, 5), SamplingParams(max_tokens=14, stop_token_ids=[ref[9]], **GREEDY), 2)]
    cfg = dict(decode_graphs=True, max_batch_tokens=10, match_unit=16)
    with torch.inference_mode():
        sync, _ = drive(make(cuda, False, **cfg), reqs)
        asyn, n = drive(make(cuda, True, **cfg), reqs)
    assert n >= 5
    for a, b in zip(asyn, sync):
        assert a["ids"] == b["ids"] and a["reason"] == b["reason"]
    assert asyn[-1]["ids"] == ref[:10]


def test_match_boundaries_do_not_drain_and_their_prefix_hits_equal_cold(model):
    """A decode step that completes a match unit stays asynchronous (its state copied at launch, the unit and
    checkpoint hashed after the read-back): with a unit of 4, every decode step overlaps (12 of 16 before),
    and a follow-up prompt restores the units and the checkpoint filed that way and still equals generate."""
    p = prompt(95, 10)
    eng = make(model, True, match_unit=4)
    first, n = drive(eng, [(p, SamplingParams(max_tokens=17, **GREEDY), 0)])
    # the prefill samples token 0; the 16 steps feeding tokens 0..15 all overlap (none samples past max_tokens)
    assert n == 16, n
    assert first[0]["ids"] == reference(model, p, 17)
    follow = p + first[0]["ids"] + prompt(96, 3)
    out = eng.generate([follow], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.cache.restored_tokens == 24, out.cache  # 10 + 17 = 27 computed: the newest boundary, 24
    assert list(out.output_ids) == reference(model, follow, 6)
    assert_pool_empty(eng)


def test_stop_token_that_completes_a_unit_files_nothing_and_frees_its_copy(model):
    """The stop token is the in-flight token of a step that completes a match unit (prompt 10, unit 4: output
    token 5 is fed at position 15, the 16th): its state copy's slot is freed, no unit of freed blocks is
    registered, and the output equals the synchronous engine's."""
    p = prompt(97, 10)
    ref = reference(model, p, 12)
    assert ref[5] not in ref[:5]  # the stop hits at token 5, not before
    reqs = [(p, SamplingParams(max_tokens=12, stop_token_ids=[ref[5]], **GREEDY), 0)]
    eng = make(model, True, match_unit=4)
    asyn, n = drive(eng, reqs)  # asserts the pool empty: a leaked copy slot would count as used
    sync, _ = drive(make(model, False, match_unit=4), reqs)
    assert n >= 4 and asyn[0]["ids"] == ref[:6] and asyn[0]["reason"] == "stop"
    assert asyn == sync
    assert len(eng.pool.free_slots) + len(eng.pool.checkpoints) == eng.pool.capacity.num_slots


@pytest.mark.parametrize("graphs", [False, True])
def test_an_in_flight_plan_of_prompt_chunks_only_feeds_host_tokens(model, graphs):
    """The H200's serve64 once killed the engine thread: the previous step's only decode ended on its in-flight
    token while a long prompt was mid-prefill, so the next plan held prompt chunks and no in-flight row, and the
    runner was handed an empty tensor of device ids (a split step with no decodes). Such a plan feeds host
    tokens; both requests equal the synchronous engine's and generate's."""
    requests = [(prompt(130, 4), SamplingParams(max_tokens=2, **GREEDY), 0),
                (prompt(131, 40), SamplingParams(max_tokens=3, **GREEDY), 0)]
    cfg = dict(decode_graphs=graphs, max_batch_tokens=16, match_unit=16)
    sync, _ = drive(make(model, False, **cfg), requests)
    eng = make(model, True, **cfg)
    asyn, _ = drive(eng, requests)
    assert (False, True) in eng.launches[1:], eng.launches  # a step of prompt chunks only, after an in-flight one
    for (p, params, _), a, b in zip(requests, asyn, sync):
        assert a["ids"] == b["ids"] == reference(model, p, params.max_tokens)
