"""The serving MLA layout's prefill rows in one pass (k3.model.mla.VarlenLayout): a step's prefill chunks gather
their contexts from the pool at once, expand them through one kv_b_proj and attend in one varlen call per layer,
in the plain eager engine and through the piecewise graphs; the tokens and logprobs stay `generate`'s."""
import pytest
import torch

import k3.model.mla as mla
from k3 import K3Config, K3ForCausalLM
from k3.model.cache import BatchCacheView
from k3.serve import SamplingParams
from k3.serve.runner import PagedBatchView
from test_serve_engine import GREEDY, model, prompt, reference  # noqa: F401
from test_serve_prefill_graphs import drive, make


@pytest.mark.parametrize("pieces", [False, True])
def test_prefill_rows_attend_once_a_layer_and_equal_generate(model, pieces, monkeypatch):
    """Several prompts arriving at different steps (chunked, mixed with decodes), then a follow-up that hits the
    first prompt's cached prefix: every step with prefill rows makes one varlen call per MLA layer over all its
    rows, the pool gather equals the row-by-row context, and the tokens are generate's."""
    calls, gathers = [], [0]
    real_attention, real_gather = mla.varlen_causal_attention, PagedBatchView.mla_prefill_context

    def attention(q, k, v, segments, scale):
        calls.append((segments.cu_q_host, segments.cu_k_host))
        return real_attention(q, k, v, segments, scale)

    def gather(view, layer_idx):
        lat, kx = real_gather(view, layer_idx)
        row_lat, row_kx = BatchCacheView.mla_prefill_context(view, layer_idx)  # mla_context a row at a time
        assert torch.equal(lat, row_lat) and torch.equal(kx, row_kx)
        gathers[0] += 1
        return lat, kx

    monkeypatch.setattr(mla, "varlen_causal_attention", attention)
    monkeypatch.setattr(PagedBatchView, "mla_prefill_context", gather)
    eng = make(model, pieces)
    n_mla = sum(isinstance(m, mla.MultiHeadLatentAttention) for m in model.modules())
    step_lens, run = [], eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda seqs, lens, *a: step_lens.append(list(lens)) or run(seqs, lens, *a))
    prompts = [prompt(60, 21), prompt(61, 9), prompt(62, 30), prompt(63, 4)]
    got, _, _ = drive(eng, [(p, SamplingParams(max_tokens=6, **GREEDY), at) for p, at in zip(prompts, [0, 0, 2, 3])])
    for p, r in zip(prompts, got):
        assert r["ids"] == reference(model, p, 6)
    follow = prompts[0] + got[0]["ids"] + prompt(64, 5)
    out = eng.generate([follow], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.cache.restored_tokens > 0, out.cache
    assert list(out.output_ids) == reference(model, follow, 4)

    prefill_steps = [lens for lens in step_lens if any(n > 1 for n in lens)]
    assert len(calls) == n_mla * len(prefill_steps) == gathers[0]
    assert any(len(cu_q) > 2 for cu_q, _ in calls)  # several prefill rows in one call
    # a chunk after its context (a later chunk or a prefix hit): more keys than queries in a segment
    assert any(kb - ka > qb - qa for cu_q, cu_k in calls
               for qa, qb, ka, kb in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention's varlen kernel)")
def test_cuda_bf16_engine_through_flash_equals_the_masked_sdpa(model, monkeypatch):
    """The engine in bf16 on CUDA takes FlashAttention's varlen kernel for its prefill rows; the prompt logprobs
    of the same requests with it switched off (the block-diagonal SDPA) agree to bf16's precision."""
    import k3.ops.varlen_attention as va
    cuda = K3ForCausalLM(K3Config.preset("tiny")).to("cuda", torch.bfloat16).eval()
    cuda.load_state_dict(model.state_dict())
    flash_calls, usable = [0], va.flash_usable

    def counted(*a):
        ok = usable(*a)
        flash_calls[0] += ok
        return ok
    prompts = [prompt(80, 21), prompt(81, 9), prompt(82, 30)]
    params = SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY)
    runs = []
    for flash in (True, False):
        monkeypatch.setattr(va, "flash_usable", counted if flash else (lambda *a: False))
        eng = make(cuda, False, decode_graphs=True)
        got, _, _ = drive(eng, [(p, params, 0) for p in prompts])
        runs.append([[x.logprob for x in r["prompt"][1:]] for r in got])
    assert flash_calls[0] > 0
    for a, b in zip(*runs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0.15)
