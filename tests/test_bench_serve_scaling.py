"""benchmarks/bench_serve_scaling.py: each layout is a real `k3 serve` (one process, then two gloo ranks) that
answers every timed request with the asked number of tokens, the table's ratio is the quotient of the layouts'
rows, and the roofline's experts are divided over the expert-parallel ranks (counted here from the checkpoint's
files)."""
import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from k3.checkpoint.random_init import write_random_checkpoint
from k3.config import K3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_k3_shaped  # noqa: E402
import bench_serve_scaling as bench  # noqa: E402


def test_two_ranks_and_one_serve_every_request_and_the_ratio_is_their_quotient(tmp_path):
    out = tmp_path / "rows.json"
    rows = bench.main(["--init", "tiny", "--dir", str(tmp_path / "ckpt"), "--nproc", "1,2", "--concurrency", "2",
                       "--input-len", "12", "--output-len", "6", "--waves", "2", "--memory-gib", "0.25",
                       "--block-size", "64", "--startup-timeout", "300", "--json", str(out)])
    assert [(r["nproc"], r["ep"], r["concurrency"]) for r in rows] == [(1, 1, 2), (2, 2, 2)]
    for r in rows:
        assert r["requests"] == 4 and r["failed"] == 0 and r["wrong_length"] == 0 and r["out_tok_per_s"] > 0
        assert r["decode_tok_per_s_stream"] == pytest.approx(1e3 / r["tpot_ms"]["mean"])
        assert r["roofline_tok_per_s"] is None  # float experts: no byte model
    assert json.loads(out.read_text()) == rows
    ratio_cell = bench.format_rows(rows).splitlines()[-1].split("|")[4].strip()
    assert ratio_cell == f"{rows[1]['out_tok_per_s'] / rows[0]['out_tok_per_s']:.2f}x"


def test_the_roofline_divides_the_touched_experts_over_the_ep_ranks(tmp_path):
    config = K3Config.preset("tiny")
    write_random_checkpoint(config, tmp_path / "m", "mxfp4")
    expert_bytes = 0
    for f in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            expert_bytes += sum(h.get_slice(n).get_shape()[0] * h.get_slice(n).get_shape()[1]
                                for n in h.keys() if ".experts." in n)  # uint8 codes and scales: a byte each
    c, bw = 8, bench.H200_BYTES_PER_S
    touched = bench_k3_shaped.expected_distinct_experts(config.num_experts, config.num_experts_per_token, c)
    one, two = (bench.roofline(tmp_path / "m", c, 64, ep, 1) for ep in (1, 2))
    # a step's bytes on a rank: the half of the touched experts it holds fewer with two ranks, the rest the same
    assert c * bw / one - c * bw / two == pytest.approx(expert_bytes * touched / config.num_experts / 2, rel=1e-9)


def test_a_float_checkpoint_has_no_roofline_and_bad_layouts_are_refused(tmp_path):
    write_random_checkpoint(K3Config.preset("tiny"), tmp_path / "f", "bf16")
    assert bench.roofline(tmp_path / "f", 8, 64, 1, 1) is None
    for bad in (["--nproc", "0"], ["--concurrency", "1,0"], ["--waves", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--model", str(tmp_path / "f"), *bad])
