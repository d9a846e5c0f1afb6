"""benchmarks/gemm_census.py's bookkeeping: each product's FLOP count, what the census records of known calls (and
of a real training step), and that a replay computes a product of the recorded shapes."""
import sys
from pathlib import Path

import pytest
import torch

from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gemm_census as census_mod  # noqa: E402


@pytest.mark.parametrize("op, a, b, offs, want", [
    ("mm", (5, 3), (3, 7), None, 2 * 5 * 3 * 7),
    ("addmm_", (5, 3), (3, 7), None, 2 * 5 * 3 * 7),
    ("bmm", (2, 5, 3), (2, 3, 7), None, 2 * 2 * 5 * 3 * 7),
    # MoE forward: 10 of a's 12 rows in groups, each against its expert's [3, 7]
    ("_grouped_mm", (12, 3), (4, 3, 7), (2, 5, 5, 10), 2 * 10 * 3 * 7),
    # a weight gradient: K split into groups (9 of 11), each group a [5, k] @ [k, 7]
    ("_grouped_mm", (5, 11), (11, 7), (4, 9), 2 * 5 * 7 * 9),
    ("_grouped_mm", (4, 5, 3), (3, 20), (6, 14), 2 * 5 * 3 * 14),
    ("_grouped_mm", (4, 5, 3), (4, 3, 7), None, 2 * 4 * 5 * 3 * 7),
])
def test_a_products_flop_count(op, a, b, offs, want):
    assert census_mod.product_flop(op, a, b, offs) == want


def test_the_census_records_each_product_once_a_shape_with_layout_and_groups():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    x, w = torch.randn(16, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # an empty group and 4 rows past the last
    with census_mod.Census() as c:
        for _ in range(3):
            a @ b
        torch.addmm(torch.zeros(6, 5), a, b)
        a @ b.t().contiguous().t()  # the same shape, b transposed: another layout
        torch._grouped_mm(x, w, offs=offs)
        a + 1  # not a product
    by_label = {(p.label(), p.layout): (n, p) for p, n in c.calls.items()}
    assert set(by_label) == {("mm 6x4 @ 4x5", "NN"), ("addmm 6x4 @ 4x5", "NN"), ("mm 6x4 @ 4x5", "NT"),
                             ("_grouped_mm 16x8 @ 3x8x4, 3 groups", "NN")}
    assert by_label["mm 6x4 @ 4x5", "NN"][0] == 3
    n, grouped = by_label["_grouped_mm 16x8 @ 3x8x4, 3 groups", "NN"]
    assert n == 1 and grouped.offs == (4, 4, 12) and grouped.flop == 2 * 12 * 8 * 4
    assert set(c.where.values()) == {"(autograd)"}  # named by k3 lines only: calls from elsewhere are marked
    for p in c.calls:  # a replay multiplies operands of the recorded shapes
        assert tuple(census_mod.replay(p, torch.device("cpu"))().shape) == \
            {"mm": (6, 5), "addmm": (6, 5), "_grouped_mm": (16, 4)}[p.op]


def test_a_training_steps_census_holds_the_lm_heads_three_products():
    """The tiny model's step: the LM head's forward [tokens, hidden] @ [hidden, vocab] from the decoder, and its two
    gradients, each the same FLOP; every k3 product of the step is counted (fla is not on the CPU)."""
    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).train()
    B, T = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    c = census_mod.census_of_step(model, ids)
    head = 2 * B * T * cfg.hidden_size * cfg.vocab_size
    with_vocab = [p for p in c.calls if cfg.vocab_size in (*p.a[0], *p.b[0])]
    assert sorted(p.flop for p in with_vocab for _ in range(c.calls[p])) == [head] * 3
    forward = [p for p in with_vocab if p.a[0] == (B * T, cfg.hidden_size)]
    assert len(forward) == 1 and c.where[forward[0]].startswith("model/decoder.py")
    assert all(p.a[2] == "float32" for p in c.calls) and sum(c.calls.values()) > 3 * cfg.num_hidden_layers
    assert all(param.grad is None for param in model.parameters())  # the census leaves no gradients behind
