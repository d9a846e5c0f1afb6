"""Time from process start to the end of the first training steps of `small` on one GPU (issue 23, "start fast").

Run it with an empty TRITON_CACHE_DIR to measure a fresh machine: the first step then pays for every Triton
autotune and compile (k3's kernels and fla's), the second shows the steady step. Phases printed: imports, model
build, first forward, first backward, first optimizer step, second step; with TRITON_PRINT_AUTOTUNING=1 Triton
also prints each autotune it runs. The shipped autotune choices (k3.ops.tuning) are pinned, and their kernels
start compiling in worker processes (k3.ops.precompile), before the model is built: K3_AUTOTUNE_TABLE=off times a
start without them, K3_PRECOMPILE_WORKERS=0 one without precompiling; --save-table PATH writes this run's choices
and compiles (merged into PATH's other GPUs) after the steps, as `k3 tune` does.
Run: PYTHONPATH=src python benchmarks/bench_cold_start.py [--batch 8 --seq 4096] [--save-table PATH]
"""
import time

T0 = time.perf_counter()
import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import save  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops import tuning  # noqa: E402


def files_under(path):
    return sum(len(names) for _, _, names in os.walk(path)) if path and os.path.isdir(path) else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--save-table", help="write the autotune choices of this run's first step here (JSON)")
    a = ap.parse_args()
    marks = {"imports_s": time.perf_counter() - T0}

    def mark(name):
        torch.cuda.synchronize()
        marks[name] = time.perf_counter() - T0
        print(f"{name:>22}: {marks[name]:7.1f} s since start", flush=True)

    # the table's choices pinned and its kernels compiling ahead while the model is built (else: at the first fla call)
    marks["autotune_choices_pinned"] = tuning.pin_for_device(torch.device("cuda"))
    cfg = K3Config.preset(a.preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    mark("model_built_s")
    for step in (1, 2):
        loss = model(ids, labels=ids).loss
        mark(f"step{step}_forward_s")
        loss.backward()
        mark(f"step{step}_backward_s")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(f"step{step}_end_s")
        marks[f"step{step}_loss"] = loss.item()  # pinned or tuned, the same configs give the same loss
    if a.save_table:  # after the timed steps: the choices, then the compiles a third step needs with them
        old = tuning.read_table(a.save_table) if os.path.exists(a.save_table) else None
        made_by = f"benchmarks/bench_cold_start.py --preset {a.preset} --batch {a.batch} --seq {a.seq}"
        kernels = tuning.record()
        compiles = tuning.record_compiles(lambda: model(ids, labels=ids).loss.backward())
        tuning.save(tuning.merge(old, torch.cuda.get_device_name(), kernels, made_by, compiles,
                                 tuning.hardware_of(torch.device("cuda"))), a.save_table)
        marks["table_compiles"] = len(compiles)
    marks["triton_cache_files"] = files_under(os.environ.get("TRITON_CACHE_DIR"))
    print(marks)
    save(f"cold_start_{a.preset}", {"args": vars(a), "marks": marks})


if __name__ == "__main__":
    main()
