"""Where the GPU time goes: torch.profiler tables for a training step and a decode step of `small` on one GPU.

Not a benchmark (no peer, no limit): the question it answers is which kernels to work on next. For each case it
prints the step's wall time, the summed kernel time, the number of kernels launched, and the top ops by self
CUDA time. Decode is profiled without a CUDA graph (a graph hides its kernels from the profiler; the kernels
are the same, only the launch gaps between them differ), eager and, with --compile, compiled.
Each decode batch also times the same step replayed from a CUDA graph: graph time minus kernel time = gaps.
Run: PYTHONPATH=src python benchmarks/profile_gpu.py [--case train,decode] [--decode-batches 1,64] [--rows 25]
     [--stack 4] [--shapes] [--ops REGEX] [--docs 512]
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu_decode import filled_cache  # noqa: E402
from gpu_bench_util import ops_matching, ops_table, save, time_ms, with_stacks  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.cuda_graph import GraphedDecodeStep  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops.fused_linear import fuse_projections  # noqa: E402


def profiled(name: str, fn, rows: int, reps: int = 3, stack: int = 0, shapes: bool = False,
             ops: str = "") -> dict:
    """Profile `reps` calls of fn after two warm-up calls; print and return the summary. stack > 0 also
    prints the top ops grouped by that many frames of their Python call stack (which line launched them);
    shapes, the top ops grouped by their inputs' shapes (which matmul, which copy); ops (a regular expression),
    those tables once more with only the ops whose names match (the small passes the top rows leave out)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes,
                 **(with_stacks() if stack else {})) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / reps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kernels) / 1e3 / reps
    summary = dict(case=name, wall_ms=wall_ms, kernel_ms=kernel_ms, kernels=len(kernels) // reps)
    print(f"\n== {name}: wall {wall_ms:.2f} ms/step, kernels {kernel_ms:.2f} ms/step, "
          f"{len(kernels) // reps} kernels/step", flush=True)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    print(table, flush=True)
    summary["table"] = table
    groupings = {"by_stack": (stack, dict(group_by_stack_n=stack), dict(max_src_column_width=110)),
                 "by_shape": (shapes, dict(group_by_input_shape=True), dict(max_shapes_column_width=90))}
    for key, (wanted, group, width) in groupings.items():
        if not wanted:
            continue
        averages = prof.key_averages(**group)
        tables = [(key, averages.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=40,
                                       **width))]
        if ops:
            tables.append((f"{key} of ops matching {ops!r}", ops_table(ops_matching(averages, ops), reps, rows)))
        for title, text in tables:
            print(f"-- {title}\n{text}", flush=True)
            summary[title] = text
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="train,decode")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="also profile the compiled decode step")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode-batches", default="1", help="comma-separated decode batch sizes")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--stack", type=int, default=0, help="also group the ops by N stack frames")
    ap.add_argument("--shapes", action="store_true", help="also group the ops by their inputs' shapes")
    ap.add_argument("--ops", default="", metavar="REGEX",
                    help="with --stack/--shapes: those tables again for the ops whose names match, e.g. "
                         "'^aten::(copy_|add|to|cat)$' or 'elementwise'")
    ap.add_argument("--docs", type=int, default=0, metavar="L",
                    help="train on rows packed with documents of L tokens (bench_gpu_train.py --docs)")
    a = ap.parse_args()
    cfg = K3Config.preset("small")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16)
    out = []
    if "train" in a.case:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
        doc_ids = ((torch.arange(a.seq, device="cuda") // a.docs).expand(a.batch, a.seq).contiguous()
                   if a.docs else None)

        def step():  # (a fresh doc_ids a step, as bench_gpu_train's: the packing is read back once a forward)
            model(ids, doc_ids=None if doc_ids is None else doc_ids.clone(), labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        name = f"train B{a.batch}xT{a.seq}" + (f" docs {a.docs}" if a.docs else "")
        out.append(profiled(name, step, a.rows, reps=2, stack=a.stack, shapes=a.shapes, ops=a.ops))
        with torch.no_grad():
            out.append(profiled(f"forward only B{a.batch}xT{a.seq}", lambda: model(ids), a.rows, reps=2))
        del opt
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if "decode" in a.case:
        model.eval()
        fuse_projections(model)  # the projections as the graphed step and the engine run them (one GEMM a mixer)
        for B in (int(b) for b in a.decode_batches.split(",")):
            tok = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
            with torch.no_grad():
                cache = filled_cache(model, cfg, B, 4096)
                out.append(profiled(f"decode B{B} ctx4096 eager", lambda: model(tok, cache=cache), a.rows,
                                    stack=a.stack, shapes=a.shapes, ops=a.ops))
                if a.compile:
                    core = torch.compile(model.model)
                    cache = filled_cache(model, cfg, B, 4096)

                    def compiled_step():
                        h = core(tok, cache=cache)
                        cache.advance(1)
                        return model.lm_head(h[:, -1])
                    out.append(profiled(f"decode B{B} ctx4096 compiled", compiled_step, a.rows))
                # the same step replayed from a graph: its time minus the kernels' is what launches and gaps cost
                cache = filled_cache(model, cfg, B, 4096)
                graphed = GraphedDecodeStep(model, cache, compile=a.compile)
                graph_ms = time_ms(lambda: graphed.step(tok), warmup=3, reps=20)
                last = out[-1]
                last["graph_ms"] = graph_ms
                last["gap_us_per_kernel"] = (graph_ms - last["kernel_ms"]) * 1e3 / max(1, last["kernels"])
                print(f"graph{'+compile' if a.compile else ''} B{B}: {graph_ms:.2f} ms/step; kernels "
                      f"{last['kernel_ms']:.2f} ms; gap {last['gap_us_per_kernel']:.2f} us per kernel", flush=True)
                cache = graphed = None
                torch.cuda.empty_cache()
    save("profile", {"cases": out})


if __name__ == "__main__":
    main()
