"""benchmarks/decode_op_census.py's counting: views and allocations are not kernels, a k3 custom op is one
whatever runs inside it, host reads are counted apart, and a model's decode step lands in the layer kinds that
ran it (the references here: no triton needed)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from decode_op_census import Census, census_of_step, layer_counts, model_for  # noqa: E402


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    """The census of the references, whatever an earlier test module of this process set: the kernel tests set
    TRITON_INTERPRET=1 at import, with which (triton installed) the census runs k3's kernels, as it is meant to on
    the CPU, and counts MLA's cache writes inside the StaticCache kernel, not as index_copy_."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@torch.library.custom_op("k3_census_test::two_adds", mutates_args=())
def _two_adds(x: torch.Tensor) -> torch.Tensor:
    return x + 1 + 1  # two kernels eagerly; one op to the census


@_two_adds.register_fake
def _(x):
    return torch.empty_like(x)


def test_views_and_allocations_are_not_counted_ops_are():
    x = torch.randn(4, 6)
    census = Census()
    with census, census.kind("MLA"):
        y = x.view(6, 4)[1:].unsqueeze(0).squeeze(0).t()  # views only
        torch.empty(3)
        z = (y + 1).reshape(-1)  # one add; a reshape of the non-contiguous sum: a copy
        x.t().contiguous()  # a copy
        float(z.sum())  # a sum, then a host read
    assert dict(census.counts) == {("MLA", "aten::add"): 1, ("MLA", "aten::clone"): 2, ("MLA", "aten::sum"): 1}
    assert dict(census.host_reads) == {"MLA": 1}


def test_a_custom_op_is_one_kernel_however_many_run_inside():
    x = torch.ones(3)
    census = Census()
    with census:
        torch.ops.k3_census_test.two_adds(x)
    assert dict(census.counts) == {("cache", "k3_census_test::two_adds"): 1}


def test_inside_counts_the_ops_a_custom_op_runs_around_its_kernel():
    """With `inside`, the op is still one in `counts`, and the kernels its body launches (two adds; a `.float()` of an
    fp32 tensor, which returns it, none) are listed apart under it."""

    @torch.library.custom_op("k3::census_test_adds_and_a_noop_cast", mutates_args=())
    def _op(x: torch.Tensor) -> torch.Tensor:
        return x.float() + 1 + 1

    _op.register_fake(lambda x: torch.empty_like(x))
    x = torch.ones(3)
    census = Census(inside=True)
    with census, census.kind("AttnRes"):
        torch.ops.k3.census_test_adds_and_a_noop_cast(x)
    assert dict(census.counts) == {("AttnRes", "k3::census_test_adds_and_a_noop_cast"): 1}
    assert dict(census.inside) == {("AttnRes", "k3::census_test_adds_and_a_noop_cast", "aten::add"): 2}


def test_a_tiny_decode_step_is_counted_by_layer_kind():
    """`tiny`'s step (6 layers: 4 KDA + 2 MLA, 1 dense MLP + 5 MoE): each kind's ops are there, the MLA layers'
    cache writes (index_copy_, one for the latents and one for k_extra) among MLA's, one embedding, one LM head
    GEMM and one greedy pick, one length increment outside the layers."""
    cfg, model = model_for("tiny", None)
    census = census_of_step(model, batch=2)
    kinds = {k for k, _ in census.counts}
    assert kinds == {"embed", "KDA", "MLA", "MoE", "dense MLP", "AttnRes", "head", "cache"}
    per = layer_counts(cfg)
    assert per == {"KDA": 4, "MLA": 2, "MoE": 5, "dense MLP": 1}
    assert census.counts["MLA", "aten::index_copy_"] == 2 * per["MLA"]
    assert census.counts["embed", "aten::embedding"] == 1
    assert census.counts["head", "aten::argmax"] == 1
    assert census.counts["cache", "aten::add_"] == 1


def test_a_bf16_census_counts_the_casts_an_fp32_one_cannot_see():
    """`--dtype bf16` builds the model in bf16 (as the H200 decodes): a cast to the fp32 compute dtype (the
    references' norms and mixes here) is then an op of its own, counted, where in fp32 it is a no-op that launches
    nothing and the census cannot see it."""
    casts = {}
    for dtype in (torch.float32, torch.bfloat16):
        _, model = model_for("tiny", None, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        census = census_of_step(model, batch=2)
        casts[dtype] = {k: c for (k, op), c in census.counts.items() if op == "aten::_to_copy"}
    assert "AttnRes" not in casts[torch.float32] and casts[torch.bfloat16]["AttnRes"] > 0
    assert sum(casts[torch.bfloat16].values()) > sum(casts[torch.float32].values())
