"""`k3 plan --serve`: the released model's serving figures against hand arithmetic from SPEC's numbers (weights
with MXFP4 experts, which tensors tensor parallelism splits, MLA latent bytes per token, KDA state per sequence),
the smallest GPU count really being the smallest, and the command line."""
import json

import pytest

from k3 import K3Config
from k3.cli import main
from k3.parallel.memory_plan import GPU_MEMORY, plan_serve, smallest_serve

H200, B200 = 141 * 10**9, 192 * 10**9
D, V, L_, E, TOPK = 7168, 163840, 93, 896, 16
N_KDA, N_MLA, N_MOE = 69, 24, 92
EXPERT_PARAMS = 33_030_144  # SPEC §2: per routed expert
# SPEC §1/§2: the released text tensors hold 1,559,965,606,912 bytes, A_log padded from 96 to 128 F32 entries
RELEASED_BYTES = 1_559_965_606_912
A_LOG_PADDING = N_KDA * 32 * 4
MLA_TOKEN = N_MLA * (512 + 64) * 2  # SPEC §3.3: 512 + 64 latent values per token per MLA layer, bf16
KDA_SEQUENCE = N_KDA * 4 * (96 * 128 * 128 + 3 * 3 * 96 * 128)  # SPEC §3.2: fp32 state + 3 conv tails of q, k, v


def expert_bytes() -> int:
    per_matrix = EXPERT_PARAMS // 3
    return N_MOE * E * 3 * (per_matrix // 2 + per_matrix // 32)


def whole_bytes() -> int:
    """What tensor parallelism leaves whole: norms and AttnRes (bf16), KDA f_a_proj (bf16) and o_norm (F32), the
    MLA low-rank inputs and their norms, the router (bf16 weight, F32 bias), the latent projections and norm."""
    per_layer = 6 * D * 2
    top = 3 * D * 2
    kda = 128 * D * 2 + 128 * 4
    mla = (1536 * D + 1536 + 576 * D + 512) * 2
    moe = E * D * 2 + E * 4 + (2 * 3584 * D + 3584) * 2
    return L_ * per_layer + top + N_KDA * kda + N_MLA * mla + N_MOE * moe


def attention_split_bytes() -> int:
    """The head-split attention tensors (bf16, F32 where SPEC §2 says)."""
    kda = (5 * 12288 * D + 12288 * 128 + 96 * D) * 2 + (3 * 12288 * 4 + 96 + 12288) * 4
    mla = (18432 * 1536 + 24576 * 512 + 2 * 12288 * D) * 2
    return N_KDA * kda + N_MLA * mla


@pytest.fixture(scope="module")
def released():
    return K3Config.preset("kimi-k3")


def test_weights_and_per_gpu_split_by_hand(released):
    p = plan_serve(released, 16, H200, context=131072, tp=8, layout="tp")
    assert p.weight_bytes == RELEASED_BYTES - A_LOG_PADDING
    assert (p.ep, p.tp) == (16, 8)
    assert p.parts["routed experts (MXFP4, 1/ep + replicas)"] == \
        expert_bytes() // 16 + (E // 16) * (expert_bytes() // (N_MOE * E))
    assert p.parts["dense weights whole on every GPU"] == whole_bytes()
    split = RELEASED_BYTES - A_LOG_PADDING - expert_bytes() - whole_bytes()
    assert p.parts["dense weights split over tp"] == split // 8
    # data-parallel attention keeps every attention tensor whole
    q = plan_serve(released, 16, H200, context=131072, tp=8, layout="dp-attention")
    assert q.parts["dense weights whole on every GPU"] == whole_bytes() + attention_split_bytes()
    assert q.parts["dense weights split over tp"] == (split - attention_split_bytes()) // 8


def test_cache_capacity_by_hand(released):
    for gpus, tp, mem in ((16, 8, H200), (32, 8, H200), (16, 4, B200)):
        p = plan_serve(released, gpus, mem, context=131072, tp=tp, layout="tp")
        assert (p.token_bytes, p.sequence_bytes) == (MLA_TOKEN, KDA_SEQUENCE // tp)
        room = mem - sum(p.parts.values())
        # a TP group of tp GPUs shares its sequences: each GPU holds all their latents and 1/tp of their KDA heads
        assert p.sequences == room // (131072 * MLA_TOKEN + KDA_SEQUENCE // tp) * (gpus // tp)
        assert p.tokens == p.sequences * 131072
        q = plan_serve(released, gpus, mem, context=8192, tp=tp, layout="dp-attention")
        room = mem - sum(q.parts.values())
        assert q.sequence_bytes == KDA_SEQUENCE
        assert q.sequences == max(room, 0) // (8192 * MLA_TOKEN + KDA_SEQUENCE) * gpus


def test_smallest_gpu_count_is_the_smallest(released):
    for mem in (H200, B200):
        best = smallest_serve(released, mem, context=131072)
        assert best is not None and best.fits and best.sequences >= 1
        # every smaller count fails in every layout it allows (it must at least hold the weights)
        assert expert_bytes() / best.gpus < mem
        for gpus in range(1, best.gpus):
            for layout in ("tp", "dp-attention"):
                for tp in (8, 4, 2, 1):
                    if gpus % tp == 0:
                        assert not plan_serve(released, gpus, mem, 131072, tp=tp, layout=layout).fits
    # 1.56 TB of weights: at least 12 H200s by bytes alone, and the experts must split evenly (896 = 2^7 x 7)
    assert smallest_serve(released, H200, 131072).gpus >= 12
    assert smallest_serve(released, B200, 131072).gpus < smallest_serve(released, H200, 131072).gpus


def test_one_gpu_holds_the_experts_once():
    """On one EP rank no replica is fetched: the k3-shaped preset's experts are 3 layers x 896 x 3 MXFP4 matrices."""
    p = plan_serve(K3Config.preset("k3-shaped"), 1, H200, 131072)
    assert (p.ep, p.tp) == (1, 1)
    assert p.parts["routed experts (MXFP4, 1/ep + replicas)"] == 3 * E * 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)
    assert p.parts["dense weights split over tp"] == 0


def test_more_gpus_more_room_and_longer_context_fewer_sequences(released):
    a = plan_serve(released, 16, H200, 131072, tp=8)
    b = plan_serve(released, 32, H200, 131072, tp=8)
    assert b.sequences > a.sequences
    c = plan_serve(released, 32, H200, 1048576, tp=8)
    assert c.sequences < b.sequences


def test_errors_name_the_flag(released):
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        plan_serve(released, 6, H200, tp=3)
    with pytest.raises(ValueError, match="--tp 8 must divide --gpus 12"):
        plan_serve(released, 12, H200, tp=8)
    with pytest.raises(ValueError, match="layout must be one of tp, dp-attention"):
        plan_serve(released, 16, H200, layout="pp")


def test_cli_serve_table_and_json(capsys, tmp_path):
    assert main(["plan", "--serve", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "smallest: 16 GPUs" in out and "MLA latents per token" in out and "27,648 B" in out
    assert main(["plan", "--serve", "--gpu", "b200", "--gpus", "16", "--tp", "8", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["gpu_memory"] == GPU_MEMORY["b200"] and j["plans"][0]["gpus"] == 16 and j["plans"][0]["tp"] == 8
    assert [p["layout"] for p in j["plans"]] == ["tp"]
    assert main(["plan", "--serve", "--gpu", "h200", "--gpus", "8"]) == 1  # 1.56 TB does not fit in 8 x 141 GB
    assert "NO" in capsys.readouterr().out
    # a config.json works as a preset does
    K3Config.preset("k3-shaped").save(tmp_path / "config.json")
    assert main(["plan", "--serve", "--config", str(tmp_path / "config.json"), "--gpu", "h200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["smallest"]["gpus"] == 1  # 57.6 GB: one H200


@pytest.mark.parametrize("argv,message", [
    (["plan", "--serve", "--gpu", "h200", "--gpu-memory", "80GB"], "give --gpu or --gpu-memory, not both"),
    (["plan", "--tp", "2", "--gpus", "8"], "--tp and --dp-attention are serving layouts: add --serve"),
    (["plan", "--gpu", "h200"], "training plans need --gpus"),
    (["plan", "--serve", "--gpus", "12", "--tp", "8"], "--tp 8 must divide --gpus 12"),
])
def test_cli_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
