"""Tensor-parallel decode (k3.parallel.tensor_parallel) of the `small` preset: T ranks, one GPU each over NCCL,
against T = 1, bf16, batch 1, 8, 64 at context 4K over a StaticCache filled as in bench_gpu_decode.py.

Rows per (T, batch, mode): step ms, tokens/s, speed-up over T = 1 in the same mode, and the per-rank roofline:
the bytes one rank must read per step (its weights, which TP splits, the routed experts the batch touches, its
KDA heads' states and conv tails read and written, the whole MLA latents of the context) over the copy bandwidth
measured on the card. Modes: "eager" (the model's forward per step) and "graph" (k3.model.cuda_graph's
GraphedDecodeStep: the collectives captured in the graph; a failure is recorded as a row). Beside them, the
all-reduce of one [batch, hidden] bf16 block timed alone: a TP step does 2 per layer + 1 (embedding) of them
and one all-gather of the logits.
Routed experts stay whole on every rank here (expert parallelism is k3.serve.distributed's), so TP alone speeds
up only the attention, KDA, dense and vocabulary parts.
Run: PYTHONPATH=src python benchmarks/bench_tensor_parallel.py --tp 1,2 (a machine with >= max T GPUs);
--device cpu runs the tiny preset on gloo in float32 (a smoke run: CPU times say nothing of GPUs).
"""
import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu_decode import filled_cache, weight_bytes  # noqa: E402
from gpu_bench_util import measure_ceilings, save, table, time_ms  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.cuda_graph import GraphedDecodeStep  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402

REPS, WARMUP = 20, 3


def cpu_ms(fn, warmup: int = WARMUP, reps: int = REPS) -> float:
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def state_bytes(cfg, batch: int, tp: int) -> int:
    """One rank's KDA states and q/k/v conv tails, fp32, read and written once per step."""
    la = cfg.linear_attn_config
    H = la.num_heads // tp
    n_kda = cfg.num_hidden_layers - len(cfg.mla_layer_ids)
    return n_kda * batch * (H * la.head_dim ** 2 + 3 * (la.short_conv_kernel_size - 1) * H * la.head_dim) * 4 * 2


def rank_main(rank: int, world: int, port: int, args, out_dir: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **({"device_id": torch.device("cuda", rank)} if cuda else {}))
    try:
        rows = measure(rank, world, args)
        if rank == 0:
            torch.save(rows, os.path.join(out_dir, "rows.pt"))
    finally:
        dist.destroy_process_group()


def measure(rank: int, world: int, args) -> list[dict]:
    cuda = args.device == "cuda"
    cfg = K3Config.preset(args.preset)
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # every rank draws the same full model, then keeps its blocks
    with torch.device(device):
        model = K3ForCausalLM(cfg).to(dtype).eval()
    apply_tensor_parallel(model)
    timer = time_ms if cuda else cpu_ms
    copy_bw = measure_ceilings()["copy_TBps"] * 1e12 if cuda else None
    R, rope, n_mla = cfg.kv_lora_rank, cfg.qk_rope_head_dim, len(cfg.mla_layer_ids)
    rows = []
    for B in args.batches:
        start = len(rows)
        tok = torch.randint(0, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(B)).to(device)
        nbytes = weight_bytes(model, cfg, B) + state_bytes(cfg, B, world) + n_mla * B * args.context * (R + rope) * 2
        base = dict(tp=world, batch=B, context=args.context, rank_MB=nbytes / 1e6)
        if copy_bw:
            base["floor_ms"] = nbytes / copy_bw * 1e3
        block = torch.randn(B, cfg.hidden_size, dtype=dtype, device=device)
        rows.append(dict(base, mode="one all-reduce", step_ms=timer(lambda: dist.all_reduce(block))))
        with torch.no_grad():
            cache = filled_cache(model, cfg, B, args.context) if cuda else model.new_cache(B, 4 * REPS)
            rows.append(dict(base, mode="eager", step_ms=timer(lambda: model(tok, cache=cache))))
            if cuda:
                cache = filled_cache(model, cfg, B, args.context)
                try:
                    graphed = GraphedDecodeStep(model, cache)
                    rows.append(dict(base, mode="graph", step_ms=timer(lambda: graphed.step(tok))))
                except Exception as e:  # noqa: BLE001 - record why, keep the other rows
                    rows.append(dict(base, mode=f"graph failed: {type(e).__name__}: {e}"[:200]))
                graphed = cache = None
                torch.cuda.empty_cache()
        for r in rows[start:]:
            if "step_ms" in r and r["mode"] != "one all-reduce":
                r["tokens_per_s"] = B / r["step_ms"] * 1e3
                if copy_bw:
                    r["roofline_frac"] = r["floor_ms"] / r["step_ms"]
        if rank == 0:
            print(rows[start:], flush=True)
    return rows


def run(world: int, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(world, port, args, out_dir), nprocs=world, join=True)
        return torch.load(os.path.join(out_dir, "rows.pt"), weights_only=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.preset = "small" if args.device == "cuda" else "tiny"
    sizes = [int(t) for t in args.tp.split(",")]
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        sys.exit(f"bench_tensor_parallel: --tp {max(sizes)} needs {max(sizes)} GPUs, this machine has "
                 f"{torch.cuda.device_count()}")
    rows = [r for t in sizes for r in run(t, args)]
    one = {(r["batch"], r["mode"]): r["step_ms"] for r in rows if r["tp"] == 1 and "step_ms" in r}
    for r in rows:
        if "tokens_per_s" in r and (r["batch"], r["mode"]) in one:
            r["speedup_vs_tp1"] = one[(r["batch"], r["mode"])] / r["step_ms"]
    cols = ["tp", "batch", "context", "mode", "step_ms", "tokens_per_s", "speedup_vs_tp1", "rank_MB", "floor_ms",
            "roofline_frac"]
    print(table(rows, cols))
    if args.device == "cuda":
        save("tensor_parallel", {"rows": rows})


if __name__ == "__main__":
    main()
