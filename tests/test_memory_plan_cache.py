"""k3.parallel.memory_plan counts a config's parameters (a meta build of the model) once per config: later plans of
an equal config reuse the counts, and a config changed in place is counted again, never served a stale entry."""
import copy

import pytest

import k3.info
from k3.config import K3Config
from k3.parallel import memory_plan
from k3.parallel.memory_plan import plan_memory, smallest_fit

GB = 10**9


@pytest.fixture
def builds(monkeypatch):
    """The model_report calls made (config dicts), on an empty cache; the report itself is the real one."""
    monkeypatch.setattr(memory_plan, "_COUNTS", {})
    calls, real = [], k3.info.model_report

    def counted(config):
        calls.append(config.to_dict())
        return real(config)
    monkeypatch.setattr(k3.info, "model_report", counted)
    return calls


def _small(seed: int) -> K3Config:
    c = K3Config.preset("tiny")
    c.num_experts = 8 * (1 + seed % 3)
    return c


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_configs_are_counted_once(builds, seed):
    config = _small(seed)
    first = plan_memory(config, 8, 80 * GB, mode="train")
    assert plan_memory(copy.deepcopy(config), 8, 80 * GB, mode="train") == first  # an equal copy: a hit
    plan_memory(config, 16, 80 * GB, mode="serve", seq_len=4096)
    smallest_fit(config, 80 * GB, mode="train", max_gpus=32)
    assert len(builds) == 1


def test_counts_are_the_reports():
    config = _small(2)
    report = k3.info.model_report(config)
    counts = memory_plan._counts(config)
    assert counts.experts == report["components"]["routed experts"] > 0
    assert counts.experts + counts.dense == report["total"]


@pytest.mark.parametrize("change", ["num_experts", "hidden_size", "kda_heads"])
def test_a_config_changed_in_place_is_counted_again(builds, change):
    config = _small(0)
    before = plan_memory(config, 8, 80 * GB, mode="train")
    if change == "num_experts":
        config.num_experts *= 2
    elif change == "hidden_size":
        config.hidden_size += 64
    else:  # a field of the nested linear-attention config
        config.linear_attn_config.num_heads *= 2
    after = plan_memory(config, 8, 80 * GB, mode="train")
    fresh = plan_memory(K3Config.from_dict(config.to_dict()), 8, 80 * GB, mode="train")
    assert len(builds) == 2
    assert after == fresh and after.parts != before.parts
