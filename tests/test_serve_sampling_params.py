"""vLLM's sampling parameters inside k3's batched sampler (logit_bias, presence/frequency/repetition penalties,
min_tokens, min_p), each checked against a plain-Python float64 reference on random logits and histories, then
end to end through LLMEngine against a full forward per step; and their bounds, refused with the field named."""
import math
import random
from collections import Counter

import pytest
import torch

from k3.model.generate import sample_rows
from k3.serve import SamplingParams
from k3.serve.sampling import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, adjust_logits, make_adjuster,
                               record_tokens, sample_tokens)
from test_serve_engine import GREEDY, assert_pool_empty, engine, model, prompt, reference  # noqa: F401

INF = float("inf")


def ref_adjust(row: list[float], p: SamplingParams, prompt_ids: list[int], output: list[int],
               banned) -> list[float]:
    """vLLM's documented order, one float64 logit at a time: min_tokens bans, logit_bias, then repetition
    (prompt and output ids: divide a positive logit, multiply a negative one), frequency (× count in the
    output) and presence (once per id in the output)."""
    x = [float(v) for v in row]
    for t in banned or ():
        x[t] = -INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts, seen = Counter(output), set(prompt_ids) | set(output)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


def random_params(rng: random.Random, V: int) -> SamplingParams:
    kind = rng.choice(["none", "bias", "penalties", "min_tokens", "all"])
    kw = {}
    if kind in ("min_tokens", "all"):
        kw.update(min_tokens=rng.randint(1, 50), stop_token_ids=rng.sample(range(V + 3), 3),
                  ignore_eos=rng.random() < 0.5)
    if kind in ("bias", "all"):
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}
    if kind in ("penalties", "all"):
        kw.update(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                  repetition_penalty=rng.choice([1.0, rng.uniform(0.3, 3.0)]))
    return SamplingParams(max_tokens=50, **kw)


@pytest.mark.parametrize("seed, S, V", [(0, 1, 17), (1, 5, 17), (2, 9, 300), (3, 4, 1000), (4, 16, 64)])
def test_adjusted_logits_equal_a_float64_reference_over_growing_histories(seed, S, V):
    """Histories grow over several steps through `record_tokens` (one scatter per step, rows without penalties
    mixed in): each step's adjusted logits equal the reference computed from the full token lists. Ids past
    the vocabulary (a tokenizer's padding) in prompts, stop ids and EOS are ignored."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    eos = {V - 1, V + 2}
    params = [random_params(rng, V) for _ in range(S)]
    prompts = [[rng.randrange(V + 5) for _ in range(rng.randint(1, 30))] for _ in range(S)]
    adjusters = [make_adjuster(sp, p, eos) for p, sp in zip(prompts, params)]
    assert adjusters.count(None) < S
    outputs = [[] for _ in range(S)]
    for step in range(6):
        logits = torch.randn(S, V, generator=gen) * 4
        banning = [rng.random() < 0.5 for _ in range(S)]
        got = adjust_logits(logits, params, adjusters, banning)
        for i in range(S):
            p = params[i]
            banned = {t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos) if t < V} \
                if banning[i] and p.min_tokens else None
            want = ref_adjust(logits[i].tolist(), p, [t for t in prompts[i] if t < V], outputs[i], banned)
            for g, w in zip(got[i].tolist(), want):
                assert (g == w == -INF) or g == pytest.approx(w, rel=1e-6, abs=1e-4)
        # duplicate picks across steps, so frequency counts go above 1
        picked = torch.tensor([rng.choice(outputs[i] or [rng.randrange(V)]) if rng.random() < 0.4
                               else rng.randrange(V) for i in range(S)])
        record_tokens(adjusters, picked)
        for i, t in enumerate(picked.tolist()):
            outputs[i].append(t)


def test_rows_asking_for_nothing_pay_nothing():
    logits = torch.randn(4, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(min_p=0.2), SamplingParams(top_k=3)]
    adjusters = [make_adjuster(p, [1, 2, 3], {4}) for p in params]
    assert adjusters == [None] * 4 and adjust_logits(logits, params, adjusters, [True] * 4) is logits


def ref_sample(row: list[float], T: float, min_p: float, top_k: int, top_p: float, u: float):
    """float64 reference of sample_rows with min_p: (token for u, or None when u falls within 1e-6 of a CDF
    edge, where float32 may round either way)."""
    z = [v / T for v in row]
    m = max(z)
    probs = [math.exp(v - m) for v in z]
    total = sum(probs)
    probs = [q / total for q in probs]
    top = max(probs)
    keep = [q >= min_p * top for q in probs]
    kept = sum(q for q, k in zip(probs, keep) if k)
    probs = [q / kept if k else 0.0 for q, k in zip(probs, keep)]
    order = sorted(range(len(z)), key=lambda t: -z[t])
    if 0 < top_k < len(z):
        for t in order[top_k:]:
            probs[t] = 0.0
    mass = sum(probs)
    ranked = [probs[t] / mass for t in order]
    before, final = 0.0, [0.0] * len(z)
    for t, q in zip(order, ranked):
        if q > 0 and before <= top_p:
            final[t] = q
        before += q
    cdf, acc = [], 0.0
    for q in final:
        acc += q
        cdf.append(acc)
    x = u * cdf[-1]
    if any(abs(x - c) < 1e-6 for c in cdf):
        return None, final
    return next(t for t, c in enumerate(cdf) if c > x), final


@pytest.mark.parametrize("seed, V", [(0, 10), (1, 40), (2, 257)])
def test_min_p_with_temperature_top_k_and_top_p_equals_a_float64_reference(seed, V):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = 24
    logits = torch.randn(rows, V, generator=gen) * 3
    T = [rng.choice([0.5, 1.0, 1.7]) for _ in range(rows)]
    mp = [rng.choice([0.0, 0.05, 0.3, 0.9, 1.0]) for _ in range(rows)]
    tk = [rng.choice([0, 1, 3, V]) for _ in range(rows)]
    tp = [rng.choice([1.0, 0.9, 0.5]) for _ in range(rows)]
    checked = dropped = 0
    for _ in range(40):
        u = torch.rand(rows, generator=gen)
        got = sample_rows(logits, T, tk, tp, u, mp).tolist()
        for i in range(rows):
            want, final = ref_sample(logits[i].double().tolist(), T[i], mp[i], tk[i], tp[i], float(u[i]))
            assert final[got[i]] > 0  # never a token min_p, top-k or top-p removed
            if want is not None:
                assert got[i] == want
                checked += 1
            dropped += sum(q == 0 for q in final)
    assert checked > 0.9 * rows * 40 and dropped > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_rows_pick_the_reference_argmax_and_logprobs_stay_raw(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    S, V = 7, 120
    params = [SamplingParams(temperature=0.0, logprobs=2, **{k: v for k, v in vars(random_params(rng, V)).items()
                                                              if k in ("logit_bias", "presence_penalty",
                                                                       "frequency_penalty", "repetition_penalty")})
              for _ in range(S)]
    prompts = [[rng.randrange(V) for _ in range(10)] for _ in range(S)]
    adjusters = [make_adjuster(sp, p) for p, sp in zip(prompts, params)]
    logits = torch.randn(S, V, generator=gen) * 3
    tokens, lps = sample_tokens(logits, params, [None] * S, None, adjusters, [False] * S)
    raw = torch.log_softmax(logits.double(), -1)
    for i in range(S):
        ref = ref_adjust(logits[i].tolist(), params[i], prompts[i], [], None)
        assert tokens[i] == max(range(V), key=lambda t: ref[t])
        assert lps[i].logprob == pytest.approx(float(raw[i, tokens[i]]), abs=1e-5)  # the model's own
    penalised = [i for i, a in enumerate(adjusters) if a is not None and a.penalized]
    assert penalised
    for i in penalised:  # the pick was counted
        assert adjusters[i].counts.tolist() == [int(t == tokens[i]) for t in range(V)]


# ---- end to end ---------------------------------------------------------------------------------------------

def loop_reference(model, ids: list[int], p: SamplingParams, n: int, stop_ids=frozenset()) -> list[int]:
    """Greedy decoding by a full forward per token, the logits adjusted by ref_adjust in float64."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids + out])).logits[0, -1].double().tolist()
        banned = (set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids)) if len(out) < p.min_tokens else None
        x = ref_adjust(row, p, ids, out, banned)
        out.append(max(range(len(x)), key=lambda t: x[t]))
        if len(out) >= p.min_tokens and (out[-1] in p.stop_token_ids or out[-1] in stop_ids):
            break
    return out


def test_engine_greedy_with_penalties_bias_and_min_tokens_equals_a_per_token_reference(model):
    prompts = [prompt(300 + i, n) for i, n in enumerate([9, 21, 4, 15])]
    base = reference(model, prompts[2], 1)
    params = [SamplingParams(max_tokens=10, repetition_penalty=1.8, **GREEDY),
              SamplingParams(max_tokens=10, frequency_penalty=-2.0, presence_penalty=0.7, **GREEDY),
              SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=base, presence_penalty=-1.0, **GREEDY),
              SamplingParams(max_tokens=8, logit_bias={t: -30.0 for t in prompts[3][:5]}, repetition_penalty=0.6,
                             **GREEDY)]
    eng = engine(model, max_batch_tokens=8)  # chunked prefill, all four batched
    outs = eng.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert list(o.output_ids) == loop_reference(model, p, sp, sp.max_tokens)
    for i in (1, 3):  # the parameters did change the output (negative penalties favour repeats)
        assert list(outs[i].output_ids) != reference(model, prompts[i], params[i].max_tokens)
    assert_pool_empty(eng)


def test_a_large_negative_bias_on_the_greedy_token_picks_the_runner_up(model):
    p = prompt(310, 12)
    with torch.no_grad():
        first, second = model(torch.tensor([p])).logits[0, -1].topk(2).indices.tolist()
    out = engine(model).generate([p], SamplingParams(max_tokens=1, logit_bias={first: -100}, **GREEDY))[0]
    assert list(out.output_ids) == [second]


def test_min_tokens_masks_eos_and_stop_ids_until_reached(model):
    p = prompt(320, 10)
    ref = reference(model, p, 8)
    eng = engine(model)
    eng.stop_ids = frozenset({ref[0]})  # as a tokenizer whose EOS the model predicts first would set it
    stopped = eng.generate([p], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert list(stopped.output_ids) == ref[:1] and stopped.finish_reason == "stop"
    held = eng.generate([p], SamplingParams(max_tokens=8, min_tokens=3, **GREEDY))[0]
    assert len(held.output_ids) >= 3 and ref[0] not in list(held.output_ids)[:3]
    assert list(held.output_ids) == loop_reference(model, p, SamplingParams(max_tokens=8, min_tokens=3, **GREEDY), 8,
                                                   eng.stop_ids)
    by_id = eng.generate([p], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[ref[0]], ignore_eos=True,
                                             **GREEDY))[0]
    assert ref[0] not in list(by_id.output_ids)[:2]
    assert_pool_empty(eng)


def test_seeded_sampling_with_penalties_and_min_p_does_not_depend_on_batch_mates(model):
    p = prompt(330, 12)
    params = SamplingParams(max_tokens=8, temperature=1.3, min_p=0.05, top_k=40, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={7: 5.0}, seed=2**64 - 1)
    alone = engine(model).generate([p], params)[0].output_ids
    crowd = engine(model, max_batch_tokens=9).generate(
        [prompt(331, 20), p, prompt(332, 7)],
        [SamplingParams(max_tokens=5, temperature=1.0, frequency_penalty=1.0, seed=1), params,
         SamplingParams(max_tokens=9, **GREEDY)])
    assert crowd[1].output_ids == alone


# ---- bounds and errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", 1e300), ("repetition_penalty", 1e-300), ("min_p", 1.5), ("min_p", -0.1),
    ("min_tokens", -1), ("min_tokens", 17), ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", [1, 2]), ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["x" * 5000]), ("stop_token_ids", [-1]),
    ("seed", 2**64), ("seed", -1), ("seed", 1.0), ("max_tokens", -1), ("ignore_eos", "yes"),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(max_tokens=16, **{field: value}) if field != "max_tokens" else SamplingParams(max_tokens=value)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(stop=["ab"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                   logit_bias={i: 100.0 for i in range(MAX_LOGIT_BIAS)}, seed=2**64 - 1, min_tokens=16,
                   presence_penalty=-2, frequency_penalty=2, min_p=1.0, max_tokens=16)


def test_three_million_stop_ids_are_refused_at_once():
    """The issue's attack: a request with 3M stop_token_ids slowed every stream 4x. It is refused by count."""
    ids = list(range(3_000_000))
    with pytest.raises(ValueError, match=rf"^stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids"):
        SamplingParams(stop_token_ids=ids)


def test_engine_refuses_ids_outside_the_vocabulary_naming_the_field(model):
    eng = engine(model)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match="^logit_bias holds token id"):
        eng.add_request(prompt(340, 5), SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="^stop_token_ids holds token id"):
        eng.add_request(prompt(340, 5), SamplingParams(stop_token_ids=[3, V + 7]))
    assert eng.add_request(prompt(340, 5), SamplingParams(max_tokens=1, seed=2**64 - 1, logit_bias={V - 1: 1.0}))
