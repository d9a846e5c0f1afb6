"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo + logprobs) come from the prefill's own forward and
equal the model's log-softmax over a plain full forward of the prompt: across chunked prefill, batching with
other sequences, 1-token chunks beside decodes (where the fixed-shape decode path must step aside), swapping,
prefix-cache hits of requests in flight, and max_tokens=0 (score only)."""
import pytest
import torch

from k3.serve import SamplingParams
from test_serve_engine import GREEDY, assert_pool_empty, engine, model, prompt, reference  # noqa: F401


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] float64: row t is the model's log-distribution of token t + 1 given ids[:t + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1)


def assert_matches_plain_forward(model, ids: list[int], got: list, k: int) -> None:
    ref = plain_logprobs(model, ids)
    assert len(got) == len(ids) and got[0] is None
    for t, g in enumerate(got[1:], start=1):
        assert g.token_id == ids[t]
        assert g.logprob == pytest.approx(float(ref[t - 1, ids[t]]), abs=2e-5)
        top = ref[t - 1].topk(k)
        assert [i for i, _ in g.top] == top.indices.tolist()
        assert [v for _, v in g.top] == pytest.approx(top.values.tolist(), abs=2e-5)


def run_collecting(eng) -> dict[str, list]:
    """Step to the end; per request, every output's prompt_logprobs (None or a list) in order."""
    seen: dict[str, list] = {}
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o.prompt_logprobs)
            if o.finished:
                finals[o.request_id] = o
    return seen, finals


@pytest.mark.parametrize("budget", [3, 7, 64])
def test_prompt_logprobs_equal_a_plain_forward_chunked_and_batched(model, budget):
    prompts = [prompt(201, 23), prompt(202, 5), prompt(203, 40), prompt(204, 11)]
    ks = [2, None, 5, 0]  # the second asks for none: its batch mates still score theirs
    eng = engine(model, max_batch_tokens=budget)
    ids = [eng.add_request(p, SamplingParams(max_tokens=3, prompt_logprobs=k, **GREEDY)) for p, k in zip(prompts, ks)]
    seen, finals = run_collecting(eng)
    for rid, p, k in zip(ids, prompts, ks):
        first, *rest = seen[rid]
        assert all(r is None for r in rest) and len(rest) == 2  # delivered once, with the first token
        if k is None:
            assert first is None
        else:
            assert_matches_plain_forward(model, p, first, k)
        assert finals[rid].output_ids == reference(model, p, 3)  # scoring leaves generation as it was
    assert_pool_empty(eng)


def test_one_token_chunks_beside_decodes_are_scored_not_replayed_as_decodes(model):
    """With a 2-token budget, a prompt's 1-token chunks share steps with another sequence's decode: every row is
    one token, which the fixed-shape decode path (CUDA graphs on a GPU) would take and lose the scores."""
    eng = engine(model, max_batch_tokens=2, decode_graphs=True)
    eng.add_request(prompt(210, 1), SamplingParams(max_tokens=30, **GREEDY))
    eng.step()
    p = prompt(211, 12)
    rid = eng.add_request(p, SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY))
    seen, finals = run_collecting(eng)
    assert_matches_plain_forward(model, p, seen[rid][0], 3)
    assert finals[rid].output_ids == reference(model, p, 2)


def test_prompt_logprobs_survive_swapping_mid_prefill(model):
    prompts = [prompt(220 + i, 30) for i in range(3)]
    eng = engine(model, num_blocks=7, max_batch_tokens=8, prefix_caching=False)
    ids = [eng.add_request(p, SamplingParams(max_tokens=12, prompt_logprobs=1, **GREEDY)) for p in prompts]
    seen, finals = run_collecting(eng)
    assert eng.scheduler.num_preemptions > 0
    for rid, p in zip(ids, prompts):
        assert_matches_plain_forward(model, p, seen[rid][0], 1)
        assert finals[rid].output_ids == reference(model, p, 12)
    assert_pool_empty(eng)


def test_a_scoring_request_never_restores_but_still_publishes(model):
    """A cache hit would skip positions whose logits are then unknown: the scoring request recomputes its whole
    prompt (reason 'prompt_logprobs') while requests in flight hold the prefix, yet what it computes is indexed,
    so the next plain request with the same prompt hits."""
    base = prompt(230, 40)
    eng = engine(model, max_batch_tokens=16)
    eng.add_request(base + prompt(231, 3), SamplingParams(max_tokens=20, **GREEDY), checkpoint_at=[36])
    while eng.scheduler.running == [] or eng.scheduler.running[0].in_prefill:
        eng.step()  # the warm request's prompt is in the cache and it is still decoding
    scored = base[:36] + prompt(232, 6)
    rid = eng.add_request(scored, SamplingParams(max_tokens=2, prompt_logprobs=4, **GREEDY))
    plain = eng.add_request(base[:36] + prompt(233, 6), SamplingParams(max_tokens=2, **GREEDY))
    seen, finals = run_collecting(eng)
    assert finals[rid].cache.reason == "prompt_logprobs" and finals[rid].cache.restored_tokens == 0
    assert finals[plain].cache.restored_tokens == 36  # the prefix was there to restore
    assert_matches_plain_forward(model, scored, seen[rid][0], 4)
    again = eng.generate([scored], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert again.cache.restored_tokens >= 40 and again.output_ids == finals[rid].output_ids
    assert_pool_empty(eng)


@pytest.mark.parametrize("n", [1, 2, 19])
def test_max_tokens_zero_scores_the_prompt_and_samples_nothing(model, n):
    p = prompt(240 + n, n)
    eng = engine(model, max_batch_tokens=7)
    rid = eng.add_request(p, SamplingParams(max_tokens=0, prompt_logprobs=2))
    bare = eng.add_request(p, SamplingParams(max_tokens=0))
    seen, finals = run_collecting(eng)
    assert seen[rid] == [finals[rid].prompt_logprobs] and seen[bare] == [None]  # one output each
    for r in (rid, bare):
        o = finals[r]
        assert (o.finished, o.finish_reason, list(o.output_ids), o.new_token_ids, o.text) == (True, "length", [], [], "")
        assert o.prompt_tokens == n
    assert_matches_plain_forward(model, p, finals[rid].prompt_logprobs, 2)
    assert_pool_empty(eng)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
