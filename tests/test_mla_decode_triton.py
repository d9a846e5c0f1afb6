"""MLA's absorbed decode straight from the paged pool (k3.ops._mla_decode_triton) against the plain softmax over
the gathered context, and through the serving engine against one-shot `generate`. On CUDA the kernel runs
natively; on a CPU with triton installed, under Triton's interpreter; without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3.ops import _mla_decode_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q_lat, q_rope, kv, tables, kv_len, scale):
    """Gather each row's context from its block table, then softmax over its first kv_len tokens (float64)."""
    R = q_lat.shape[-1]
    out = []
    for s in range(q_lat.shape[0]):
        ctx = kv[tables[s]].flatten(0, 1)[:int(kv_len[s])].double()  # [n, R + E]
        scores = (q_lat[s].double() @ ctx[:, :R].T + q_rope[s].double() @ ctx[:, R:].T) * scale
        out.append(torch.softmax(scores, -1) @ ctx[:, :R])
    return torch.stack(out)


@pytest.mark.parametrize("S,H,R,E,block_size,lens", [
    (3, 12, 64, 32, 16, [1, 17, 40]),        # a context of one token, partial blocks
    (2, 20, 128, 64, 64, [64, 300]),         # heads over two programs, a block edge
    (1, 4, 32, 16, 16, [1200]),              # one long row: the context splits across programs
])
def test_paged_decode_matches_gathered_softmax(S, H, R, E, block_size, lens):
    gen = torch.Generator().manual_seed(S * 1000 + R + len(lens))
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    max_len = max(lens)
    width = -(-max_len // block_size) + 1  # one spare column: padding past each row's blocks is never read
    num_blocks = S * width + 3
    kv = r(num_blocks, block_size, R + E).to(DEVICE)
    perm = torch.randperm(num_blocks, generator=gen)[:S * width].view(S, width)  # scattered, not in order
    tables, kv_len = perm.to(DEVICE), torch.tensor(lens, device=DEVICE)
    q_lat, q_rope = r(S, H, R).to(DEVICE), r(S, H, E).to(DEVICE)
    scale = (R + E) ** -0.5
    got = _mla_decode_triton.paged_mla_decode(q_lat, q_rope, kv, tables, kv_len, max_len + 5, scale)
    want = reference(q_lat, q_rope, kv, tables, kv_len, scale)
    assert got.shape == (S, H, R) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_engine_decodes_through_the_paged_kernel(monkeypatch, decode_graphs):
    """The serving engine's MLA decodes read the pool through the kernel (forced on for CPU tensors here):
    each generated token's log-probability equals a plain full forward's to 1e-4 and the greedy tokens equal
    one-shot `generate` (which never touches the pool), for requests whose contexts cross block edges, eagerly
    and through the fixed-shape (CUDA-graph) step."""
    import k3.model.mla as mla
    from k3 import K3Config, K3ForCausalLM
    from k3.serve import EngineConfig, LLMEngine, SamplingParams

    real_use, real_decode, calls = mla.use_triton, _mla_decode_triton.paged_mla_decode, []
    monkeypatch.setattr(mla, "use_triton", lambda x, name: name == "_mla_decode_triton" or real_use(x, name))
    monkeypatch.setattr(_mla_decode_triton, "paged_mla_decode", lambda *a: calls.append(1) or real_decode(*a))
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).to(DEVICE).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 8000, (n,), generator=gen).tolist() for n in (5, 14, 30)]
    eng = LLMEngine(model, None, EngineConfig(memory_bytes=16 << 20, block_size=16, match_unit=4,
                                              max_batch_tokens=64, max_num_seqs=4, decode_graphs=decode_graphs))
    ids = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)) for p in prompts]
    steps = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            steps[o.request_id] += o.new_logprobs
    assert calls  # the decodes went through the kernel
    for rid, p in zip(ids, prompts):
        tokens = [g.token_id for g in steps[rid]]
        assert tokens == model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=12)[0, len(p):].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([p + tokens[:-1]], device=DEVICE)).logits[0, len(p) - 1:]
        want = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), tokens]
        torch.testing.assert_close(torch.tensor([g.logprob for g in steps[rid]], dtype=torch.float64), want.cpu(),
                                   rtol=0, atol=1e-4)
