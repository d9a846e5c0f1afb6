"""Mixed steps split in two (k3.serve.runner.ModelRunner._run_split): the decoding rows of a step that also feeds
prompt chunks replay their decode graph (on a CPU: the same fixed-shape step, eagerly), the chunks run in an
eager forward of their own. Checked against the unsplit engine (one eager forward over every row) and against
the model's own one-shot `generate`: same tokens, same sampled tokens and logprobs, same prompt logprobs."""
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.serve import EngineConfig, LLMEngine, SamplingParams
from k3.serve.runner import ModelRunner
from test_serve_engine import model, prompt  # noqa: F401  (the serving tests' tiny model and prompts)


def run(model, split: bool, requests, budget: int = 12, reverse: bool = False):
    """Requests (prompt, params, step to arrive at) through an engine with graphs on → (per request: output ids,
    sampled logprobs, prompt logprobs; the decoding rows of each split step). reverse: each step's rows in the
    reverse of the scheduler's order (prompt chunks before decodes: a row's place in a step means nothing)."""
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4,
                                              max_batch_tokens=budget, max_num_seqs=8, decode_graphs=True,
                                              split_mixed_steps=split))
    splits = []
    inner = eng.runner._run_split

    def counted(*a, **k):
        splits.append(len(a[3]))  # decoding rows in this split step
        return inner(*a, **k)
    eng.runner._run_split = counted
    if reverse:
        schedule = eng.scheduler.schedule
        eng.scheduler.schedule = lambda: tuple(x[::-1] for x in schedule())
    ids, outs, step = [None] * len(requests), {}, 0
    while step == 0 or eng.has_unfinished() or any(i is None for i in ids):
        for k, (p, params, at) in enumerate(requests):
            if at == step:
                ids[k] = eng.add_request(p, params)
        for o in eng.step():
            rec = outs.setdefault(o.request_id, {"ids": None, "lp": [], "prompt": None})
            rec["lp"] += o.new_logprobs
            if o.prompt_logprobs is not None:
                rec["prompt"] = o.prompt_logprobs
            if o.finished:
                rec["ids"] = list(o.output_ids)
        step += 1
    assert eng.pool.num_used_blocks == 0 and eng.pool.num_used_slots == 0
    if eng.runner.graphs.capture:  # on CUDA: every shape used was captured and replayed
        assert all(g is not None for _, g, _ in eng.runner.graphs.entries.values())
    return [outs[i] for i in ids], splits


def test_split_mixed_steps_equal_unsplit_engine_and_generate(model):
    """Greedy requests arriving while others decode: mixed steps are split (decodes of one to several rows),
    and the tokens equal both the unsplit engine's and one-shot generate's."""
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)  # noqa: E731
    requests = [(prompt(1, 5), greedy(12), 0), (prompt(2, 9), greedy(10), 0), (prompt(3, 30), greedy(6), 3),
                (prompt(4, 17), greedy(8), 4), (prompt(5, 40), greedy(5), 6)]
    split, n_split = run(model, True, requests)
    plain, n_plain = run(model, False, requests)
    assert n_plain == [] and len(n_split) >= 4 and max(n_split) >= 2, n_split
    for (p, params, _), a, b in zip(requests, split, plain):
        ref = model.generate(torch.tensor([p]), max_new_tokens=params.max_tokens, eos_token_id=None)[0, len(p):]
        assert a["ids"] == b["ids"] == ref.tolist()


def test_split_keeps_sampled_logprobs_and_prompt_logprobs(model):
    """Seeded sampling with logprobs on the decoding rows, and prompt logprobs on a prompt that arrives
    mid-decode, each step's rows reversed (chunks first): the split step hands back each row's logits in the step's order and the chunk's prompt scores
    under the step's own row indices, so tokens, logprobs and prompt logprobs equal the unsplit engine's."""
    sampled = lambda n, seed: SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=seed,  # noqa: E731
                                             logprobs=3)
    scored = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, logprobs=1)
    requests = [(prompt(11, 6), sampled(10, 7), 0), (prompt(12, 8), sampled(9, 8), 0),
                (prompt(13, 25), scored, 3), (prompt(14, 3), sampled(6, 9), 5)]
    split, n_split = run(model, True, requests, budget=10, reverse=True)
    plain, _ = run(model, False, requests, budget=10)
    assert len(n_split) >= 2, n_split
    for a, b in zip(split, plain):
        assert a["ids"] == b["ids"]
        assert len(a["lp"]) == len(b["lp"]) > 0
        for x, y in zip(a["lp"], b["lp"]):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert (a["prompt"] is None) == (b["prompt"] is None)
    got, want = split[2]["prompt"], plain[2]["prompt"]
    assert got is not None and len(got) == len(want) == 25
    for x, y in zip(got[1:], want[1:]):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_no_split_without_graphs_or_when_switched_off(model):
    """The split needs decode graphs (decode_graphs=False keeps one eager forward per step) and honours
    split_mixed_steps=False."""
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4,
                                              max_batch_tokens=12, max_num_seqs=8, decode_graphs=False))
    assert eng.runner.graphs is None
    runner = ModelRunner(model, eng.pool, True, 8, split_mixed=False)
    assert runner.graphs is not None and not runner.split_mixed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_steps_replay_real_cuda_graphs_equal_unsplit_engine(model):
    """On CUDA the decodes of a mixed step replay captured graphs (padded rows and block tables, the pool's
    scratch slot) while the prompt chunks run eagerly after them on the same stream: fp32, so no tie flips a
    token, the tokens equal the unsplit engine's (one eager forward a mixed step), and every graph shape used
    was captured (see `run`)."""
    cuda = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cuda.load_state_dict(model.state_dict())
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)  # noqa: E731
    requests = [(prompt(21, 5), greedy(12), 0), (prompt(22, 9), greedy(10), 0), (prompt(23, 30), greedy(6), 3),
                (prompt(24, 17), greedy(8), 4), (prompt(25, 40), greedy(5), 6)]
    split, n_split = run(cuda, True, requests)
    plain, _ = run(cuda, False, requests)
    assert len(n_split) >= 4, n_split
    for (_, params, _), a, b in zip(requests, split, plain):
        assert a["ids"] == b["ids"] and len(a["ids"]) == params.max_tokens
