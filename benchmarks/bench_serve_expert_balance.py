"""Expert-parallel serving under skewed routing, with and without balanced replicas (k3.serve.expert_balance).

Each of --nproc gloo ranks holds E/R experts of one latent-MoE layer (k3.serve.expert_shard) and every step
computes its slots of the same N tokens (sparse: only its own slots), then one all-reduce sums the shares. A router
bias makes every token pick the --hot experts, all homed on rank 0. With replicas, the placement is made from a
warm-up window's load (`rebalance`, as `k3 serve --ep-replicas` does every --ep-rebalance-steps steps) and the
measured steps draw fresh routing from the same distribution. Both configurations live in each rank and take
turns on the same routing every step, so a busy machine slows both alike. Per configuration (medians over --steps
steps):
  rows        expert slots each rank computes per step (max and mean over ranks; max/mean: the straggler factor)
  expert CPU ms   the slowest rank's expert work (its partial sum) in CPU time: what a step's expert part takes
                  with a core per rank, whatever else the machine runs
  expert wall ms  the same in wall time (ranks > free cores: the ranks share cores, and the total work decides)
  step wall ms    partial sum + all-reduce, ranks lined up by a barrier first
Run: OMP_NUM_THREADS=1 python benchmarks/bench_serve_expert_balance.py [--nproc 2] [--tokens 256] [--replicas 2]
"""
import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3 import K3Config
from k3.model.moe import LatentMoE
from k3.serve.expert_shard import ExpertShardCombine, rebalance


def _routing(g: torch.Generator, n: int, E: int, k: int, hot: int) -> torch.Tensor:
    bias = torch.zeros(E)
    bias[:hot] = 10.0
    return torch.topk(torch.rand(n, E, generator=g) + bias, k).indices


def _layer(a, rank: int, world: int, replicas: int) -> ExpertShardCombine:
    """One latent-MoE layer's experts, this rank's E/R of them (plus room for replicas), identical on every rank."""
    config = K3Config.preset("tiny").replace(num_experts=a.experts, num_experts_per_token=a.top_k,
                                             routed_expert_hidden_size=a.latent, moe_intermediate_size=a.inter)
    torch.manual_seed(0)
    moe = LatentMoE(config)
    per = a.experts // world
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            w = getattr(moe.experts, name)
            w.normal_(0, 0.02)
            setattr(moe.experts, name, torch.nn.Parameter(w[rank * per:(rank + 1) * per].clone(), requires_grad=False))
    return ExpertShardCombine(moe, rank * per, dist.group.WORLD, "sparse", replicas, rank, world, track=True)


def _rank(rank: int, world: int, port: int, a, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # both configurations in one process, stepped alternately on the same routing: a busy machine slows both alike
    runs = {"plain": _layer(a, rank, world, 0), "replicas": _layer(a, rank, world, a.replicas)}
    g = torch.Generator().manual_seed(1)  # the same routing on every rank, as serving ranks see
    z = torch.randn(a.tokens, a.latent, generator=g)
    w = torch.rand(a.tokens, a.top_k, generator=g)
    with torch.inference_mode():
        for _ in range(a.warmup):  # the window the placement is made from
            idx = _routing(g, a.tokens, a.experts, a.top_k, a.hot)
            for combine in runs.values():
                combine(z, idx, w)
        rebalance([runs["replicas"]], dist.group.WORLD)
        stats = {name: {"rows": [], "compute": [], "cpu": [], "step": []} for name in runs}
        for i in range(a.steps):
            idx = _routing(g, a.tokens, a.experts, a.top_k, a.hot)
            for name in (list(runs) if i % 2 else list(runs)[::-1]):
                combine, out = runs[name], stats[name]
                before = int(combine.rows)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                r = combine.partial(z, idx, w)
                t1, c1 = time.perf_counter(), time.thread_time()
                dist.all_reduce(r)
                t2 = time.perf_counter()
                out["rows"].append(int(combine.rows) - before)
                out["compute"].append((t1 - t0) * 1e3)
                out["cpu"].append((c1 - c0) * 1e3)
                out["step"].append((t2 - t0) * 1e3)
    result = {name: {"rows": statistics.mean(s["rows"]), "compute": statistics.median(s["compute"]),
                     "cpu": statistics.median(s["cpu"]),
                     "step": statistics.median(s["step"]),
                     "held": len(runs[name].placement.replicas[rank]) if runs[name].placement else 0}
              for name, s in stats.items()}
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="tokens per step (every rank sees all of them)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hot", type=int, default=4, help="experts every token picks (rank 0's first)")
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--replicas", type=int, default=2, help="replicas per rank in the balanced run")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    print(f"| {a.nproc} gloo ranks, {a.tokens} tokens × top-{a.top_k} of {a.experts} experts ({a.hot} hot), latent "
          f"{a.latent}, inter {a.inter} | rows max / mean | max/mean | expert CPU ms (slowest rank) | expert wall ms "
          f"(slowest rank) | step wall ms |")
    print("|---|---:|---:|---:|---:|---:|")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(a.nproc, port, a, out_dir), nprocs=a.nproc, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(a.nproc)]
    for name in ("plain", "replicas"):
        rows = [r[name]["rows"] for r in ranks]
        mean = sum(rows) / len(rows)
        label = f"--ep-replicas {a.replicas} ({sum(r[name]['held'] for r in ranks)} held)" if name == "replicas" \
            else "home experts only"
        print(f"| {label} | {max(rows):.0f} / {mean:.0f} | {max(rows) / mean:.2f} | "
              f"{max(r[name]['cpu'] for r in ranks):.1f} | {max(r[name]['compute'] for r in ranks):.1f} | "
              f"{ranks[0][name]['step']:.1f} |")


if __name__ == "__main__":
    main()
