"""BatchCacheView.prefill_span: consecutive prefill rows hold one run of tokens, which the KDA layers then read
and write through slices (views) instead of index gathers; any other order keeps the gathers. The engine's
equalities (tests/test_serve_engine.py: chunked prefill and batching == one-shot generate) run through the slices."""
import pytest
import torch

from k3.model.cache import BatchCacheView


def layout(lens):
    view = BatchCacheView.__new__(BatchCacheView)  # the layout part alone: no storage behind it
    view.set_layout(lens, [n + 3 for n in lens], "cpu")
    return view


@pytest.mark.parametrize("lens,rows,tokens", [
    ([5, 7], (0, 2), (0, 12)),            # prefill only
    ([1, 1, 5, 7], (2, 4), (2, 14)),      # decodes first
    ([4, 6, 1, 1, 1], (0, 2), (0, 10)),   # decodes last
    ([1, 9, 1], (1, 2), (1, 10)),         # one chunk between decodes
])
def test_consecutive_prefill_rows_are_one_slice_of_rows_and_of_tokens(lens, rows, tokens):
    view = layout(lens)
    r, t = view.prefill_span
    assert (r.start, r.stop) == rows and (t.start, t.stop) == tokens
    # the slices select exactly what the gather indices do
    assert torch.arange(len(lens))[r].tolist() == view.prefill_rows_t.tolist()
    assert torch.arange(sum(lens))[t].tolist() == view.prefill_tokens_t.tolist()


@pytest.mark.parametrize("lens", [[5, 1, 7], [1, 1, 1], [2, 1, 1, 3]])
def test_other_layouts_keep_the_gathers(lens):
    assert layout(lens).prefill_span is None


@pytest.mark.parametrize("lens", [[5, 1, 7], [2, 1, 1, 3], [1, 4], [6]])
def test_prefill_token_positions_are_each_chunks_tokens_in_order(lens):
    """Gathered (no span) or built on first use (a span covers them): the same positions, chunk after chunk."""
    cu = [sum(lens[:i]) for i in range(len(lens) + 1)]
    want = [t for r, n in enumerate(lens) if n > 1 for t in range(cu[r], cu[r + 1])]
    assert layout(lens).prefill_tokens_t.tolist() == want


@pytest.mark.parametrize("seed", range(4))
def test_token_slots_equal_each_tokens_block_and_offset(seed):
    """runner.token_slots (a range per block run) against the per-token formula, at odd block sizes, chunks
    starting and ending mid-block and spanning several blocks."""
    from types import SimpleNamespace

    from k3.serve.runner import token_slots
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 9, (1,), generator=g))
    seqs, lens = [], []
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        done, n = (int(x) for x in torch.randint(0, 30, (2,), generator=g))
        n += 1
        table = torch.randperm(64, generator=g)[:-(-(done + n) // bs)].tolist()
        seqs.append(SimpleNamespace(num_computed=done, block_table=table))
        lens.append(n)
    want = [s.block_table[p // bs] * bs + p % bs for s, n in zip(seqs, lens)
            for p in range(s.num_computed, s.num_computed + n)]
    assert token_slots(seqs, lens, bs) == want
