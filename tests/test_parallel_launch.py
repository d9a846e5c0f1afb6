"""Launch checks (single process): bad --dp/--ep/--cp layouts fail with clear messages before any process
starts, sequence shards are contiguous and balanced, and `k3 plan` adds up, fits, and finds the smallest fit."""
import pytest

from k3.cli import main
from k3.config import K3Config
from k3.parallel import ParallelDims
from k3.parallel.context_parallel import shard_bounds
from k3.parallel.memory_plan import parse_bytes, plan_memory, smallest_fit


@pytest.mark.parametrize("dims,kw,match", [
    (ParallelDims(dp=2, ep=3), dict(world_size=2), "--ep 3 must divide the world size"),
    (ParallelDims(dp=4, ep=4), dict(num_experts=6), "--ep 4 must divide the number of routed experts 6"),
    (ParallelDims(dp=1, cp=4), dict(seq_len=3), "--cp 4 is larger than the sequence length 3"),
    (ParallelDims(dp=2, cp=2), dict(world_size=8), r"--dp 2 × --cp 2 = 4 must equal the number of processes"),
    (ParallelDims(dp=0), {}, "--dp must be an integer >= 1"),
])
def test_bad_layouts_fail_clearly(dims, kw, match):
    with pytest.raises(ValueError, match=match):
        dims.validate(**kw)


def test_cli_rejects_bad_launch_before_starting_processes(capsys, tmp_path):
    assert main(["train", "--nproc", "2", "--ep", "3"]) == 2
    assert "--ep 3 must divide the world size" in capsys.readouterr().err
    assert main(["train", "--nproc", "4", "--cp", "4", "--seq-len", "3"]) == 2
    assert "larger than the sequence length 3" in capsys.readouterr().err
    assert main(["train", "--nproc", "2", "--ep", "2", "--preset", "tiny", "--dp", "1"]) == 2  # dp × cp ≠ nproc
    assert "must equal the number of processes" in capsys.readouterr().err
    assert main(["train", "--nproc", "2", "--batch-size", "3"]) == 2
    assert "--batch-size 3 must be divisible by --dp 2" in capsys.readouterr().err
    assert main(["train", "--fsdp", "--out", str(tmp_path)]) == 2  # one process: nothing to shard over
    assert "--fsdp" in capsys.readouterr().err


@pytest.mark.parametrize("T,cp", [(11, 2), (10, 3), (3, 3), (100, 7)])
def test_shards_are_contiguous_and_balanced(T, cp):
    b = shard_bounds(T, cp)
    assert b[0][0] == 0 and b[-1][1] == T and all(b[i][1] == b[i + 1][0] for i in range(cp - 1))
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512") == 512
    with pytest.raises(ValueError, match="--gpu-memory"):
        parse_bytes("lots")


def test_plan_scales_with_gpus_and_counts_the_experts():
    config = K3Config.preset("kimi-k3")
    mem = parse_bytes("141GB")
    a = plan_memory(config, 64, mem, mode="train")
    b = plan_memory(config, 128, mem, mode="train")
    assert b.total < a.total  # more GPUs, less each
    # MXFP4 experts: 2,722,740,830,208 routed expert parameters × 4.25 bits over ep = 64 GPUs, + one layer's
    # replicas (14 experts × 33,030,144 parameters)
    assert a.ep == 64 and a.parts["expert weights (MXFP4)"] == int((2722740830208 / 64 + 14 * 33030144) * 4.25 / 8)
    s = plan_memory(config, 128, mem, mode="serve", seq_len=131072, batch=128)
    # one sequence per GPU: 24 MLA layers × 576 values × 2 B per token
    assert s.parts["MLA latent KV (bf16)"] == 24 * 576 * 2 * 131072
    best = smallest_fit(config, mem, mode="train")
    assert best is not None and best.fits
    assert not plan_memory(config, best.gpus - 1, mem, mode="train").fits


def test_plan_cli(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--gpus", "448", "--gpu-memory", "141GB"]) == 0  # ep 448
    out = capsys.readouterr().out
    assert "fits" in out and "smallest layout that fits" in out
    assert main(["plan", "--gpus", "8", "--gpu-memory", "141GB"]) == 1  # 2.8T parameters do not train on 8
    assert "does NOT fit" in capsys.readouterr().out
