"""`k3 info` parameter accounting: the released totals, component sums, and a real tiny model."""
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.info import format_report, model_report



@pytest.fixture(scope="module")
def k3_report():
    return model_report(K3Config.preset("kimi-k3"))


def test_released_totals(k3_report):
    # Both figures are the published ones (SPEC §1: text 2,779,484,478,208; ~104.19B activated per token).
    assert k3_report["total"] == 2_779_484_478_208
    assert k3_report["activated"] == 104_189_614_848


def test_components_sum_to_total(k3_report):
    assert sum(k3_report["components"].values()) == k3_report["total"]
    # SPEC §2: each routed expert holds 33,030,144 parameters, 896 of them in each of 92 MoE layers
    assert k3_report["components"]["routed experts"] == 92 * 896 * 33_030_144
    assert k3_report["layers"] == {"kda": 69, "mla": 24, "dense": 1, "moe": 92}


def test_cache_sizes_from_the_spec_shapes(k3_report):
    # SPEC: 24 MLA layers cache a 512-wide latent + 64 rope dims per token in bf16; 69 KDA layers hold a 96 x 128 x 128
    # fp32 state per sequence plus the q/k/v short-conv tails (kernel 4: 3 past positions of 96 x 128, fp32)
    assert k3_report["mla_cache_bytes_per_token_bf16"] == 24 * (512 + 64) * 2
    assert k3_report["kda_state_bytes_per_sequence"] == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 4)


def test_tiny_total_equals_a_real_model():
    cfg = K3Config.preset("tiny")
    report = model_report(cfg)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    counted = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    # The report counts what the released checkpoint stores: A_log is kept as [num_heads] in the model but
    # written zero-padded to a multiple of 128 (96 → 128 in K3; 4 → 128 here), once per KDA layer.
    # The router bias is a buffer, not a parameter, but it is a checkpoint tensor, so it is counted too.
    H = cfg.linear_attn_config.num_heads
    n_kda = report["layers"]["kda"]
    assert n_kda == sum(not cfg.is_mla(l) for l in range(cfg.num_hidden_layers))
    assert report["total"] == counted + n_kda * (128 - H)
    assert sum(report["components"].values()) == report["total"]
    assert 0 < report["activated"] < report["total"]


def test_format_report_mentions_totals(k3_report):
    text = format_report("kimi-k3", K3Config.preset("kimi-k3"), k3_report)
    assert "2,779,484,478,208" in text and "104,189,614,848" in text
