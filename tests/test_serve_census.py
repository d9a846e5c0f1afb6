"""profile_serve's op census: its baseline row (the model's own forward, KDA cores counted apart) adds up, and
its counter skips views and allocations but counts each kernel-launching op once (a real cast too, though
aten.to is a view op by schema), by where and by name."""
import sys
from pathlib import Path

import torch

from test_serve_engine import model  # noqa: F401  (the serving tests' tiny model)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_op_census_counts_launching_ops_by_where_and_name():
    from profile_serve import OpCensus

    tally = OpCensus()
    with torch.inference_mode(), tally:
        x = torch.empty(4)  # an allocation: no kernel
        x.fill_(1.0)
        tally.where = "runner"
        y = (x.view(2, 2) + 2) * 3  # a view (none), then add and mul
        tally.where = "cast"
        same, half = y.to(torch.float32), y.to(torch.bfloat16)  # a no-op `to` (none), then a real cast (one)
    assert y.sum().item() == 36 and same is y and half.dtype == torch.bfloat16
    assert tally.counts["engine"] == 1 and tally.counts["runner"] == 2 and tally.counts["cast"] == 1
    assert tally.counts[("engine", "fill_")] == 1
    assert tally.counts[("runner", "add")] == tally.counts[("runner", "mul")] == 1
    assert not any(isinstance(k, tuple) and k[1] in ("empty", "view") for k in tally.counts)


def test_forward_census_counts_each_kda_layer_once_and_its_ops_add_up(model):  # noqa: F811
    from profile_serve import forward_census

    rows, tokens = 3, 15  # 5 tokens a row
    row = forward_census(model, tokens, rows, model.config.vocab_size)
    assert row["kind"] == "model forward [3, 5]"
    assert row["kda_core_calls"] == len(model.config.linear_attn_config.kda_layers)
    assert row["model"] > 0 and row["model"] == sum(n for k, n in row["ops"].items() if k.startswith("model/"))
    assert any(k.startswith("kda core/") for k in row["ops"])  # the cores' own ops, apart from the model's
