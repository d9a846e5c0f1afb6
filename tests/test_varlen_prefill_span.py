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
