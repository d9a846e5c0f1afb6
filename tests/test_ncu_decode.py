"""benchmarks/ncu_decode.py's reading of Nsight Compute's raw CSV: units, grouping by kernel, the stall ranking."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ncu_decode  # noqa: E402

METRICS = ["gpu__time_duration.sum", "dram__bytes.sum.per_second",
           "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
           "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active",
           "sm__maximum_warps_per_active_cycle_pct", "launch__registers_per_thread", "launch__grid_size",
           "launch__block_size", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"]


def _csv(tmp_path, kernels):
    """A raw page as `ncu --import R --csv --page raw` prints it: a preamble line, names, units, a row a kernel."""
    head = ["ID", "Kernel Name", *METRICS]
    units = ["", "", "us", "Tbyte/s", "%", "%", "%", "%", "register/thread", "", "", "inst", "inst", "inst"]
    lines = ['==PROF== Disconnected', ",".join(f'"{h}"' for h in head), ",".join(f'"{u}"' for u in units)]
    for i, (name, us, tbps, stalls) in enumerate(kernels):
        vals = [i, name, us, tbps, 1, 50, 40, 50, 128, f"{768 * (i + 1):,}", 128, *stalls]
        lines.append(",".join(f'"{v}"' for v in vals))
    path = tmp_path / "raw.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_units_and_thousands_separators_are_read(tmp_path):
    ks = ncu_decode.read_raw(_csv(tmp_path, [("k", 2.5, 3.0, (1, 2, 9)), ("j", 1.0, 1.0, (1, 2, 9))]))
    assert len(ks) == 2
    assert ks[0]["gpu__time_duration.sum"] == pytest.approx(2.5)
    assert ks[0]["dram__bytes.sum.per_second"] == pytest.approx(3000.0)  # 3 Tbyte/s in GB/s
    assert ks[1]["launch__grid_size"] == pytest.approx(1536)  # "1,536"
    assert ks[0]["Kernel Name"] == "k"


def test_table_groups_calls_ranks_by_total_time_and_names_the_largest_stalls(tmp_path):
    kernels = [("void cutlass::Kernel2<gemm_64x64>(Params)", 10.0, 0.1, (1.0, 2.0, 50.0)),
               ("_gate_up_kernel", 20.0, 2.0, (7.0, 3.0, 50.0)),
               ("_gate_up_kernel", 30.0, 1.0, (9.0, 1.0, 50.0)),
               ("void cutlass::Kernel2<gemm_64x64>(Params)", 10.0, 0.1, (1.0, 2.0, 50.0))]
    lines = ncu_decode.table(ncu_decode.read_raw(_csv(tmp_path, kernels))).splitlines()
    assert lines[0] == "4 kernels, 70.0 µs of kernel time"
    rows = [ln.split(" | ") for ln in lines[3:]]
    assert [r[0] for r in rows] == ["| _gate_up_kernel", "| Kernel2<gemm_64x64>"]  # 50 µs before 20
    gate_up = rows[0]
    assert gate_up[1:4] == ["2", "25.0", "71.4%"]  # calls, mean µs, share of 70
    assert gate_up[4:6] == ["37.50", "1500"]  # mean rate 1.5 TB/s times 25 µs
    # the stall ratios averaged over the calls, largest first; "not_issued" is not a stall reason
    assert gate_up[-1].startswith("long_scoreboard 8.0, barrier 2.0")
    assert "not_issued" not in lines[3] + lines[4]


def test_short_names_keep_cublas_tiles_and_drop_parameters():
    assert ncu_decode.short_name("void cutlass::Kernel2<cutlass_80_tensorop_128x64>(T1::Params)") == \
        "Kernel2<cutlass_80_tensorop_128x64>"
    assert ncu_decode.short_name("_kda_decode_kernel") == "_kda_decode_kernel"
