"""Scale-out benchmarks (k3.parallel). Three parts, printed as tables:

  planner  (one process)          MoonEP plan time per layer at K3 shapes (896 experts, top-16), device vs host
  a2a      (torchrun, 2+ GPUs)    EP dispatch+combine bandwidth against a bare NCCL all_to_all_single
  train    (torchrun, 1–2 GPUs)   tokens/s of a preset (`small`; `scale-out` at 32K): 1 GPU, EP=2 (dp 2), CP=2
  muon     (torchrun, 2+ ranks)   Muon step of a preset's replicated matrices: every rank orthogonalising all of them
                                  against each matrix once by its owner rank plus one all-gather (CPU: gloo)

  python benchmarks/bench_parallel.py planner [--device cuda]
  torchrun --nproc-per-node 2 benchmarks/bench_parallel.py a2a
  torchrun --nproc-per-node 1 benchmarks/bench_parallel.py train      # baseline
  torchrun --nproc-per-node 2 benchmarks/bench_parallel.py train --ep 2
  torchrun --nproc-per-node 2 benchmarks/bench_parallel.py train --cp 2
  torchrun --nproc-per-node 2 benchmarks/bench_parallel.py train --preset scale-out --seq 32768 --batch 2 --ep 2 \
      --recompute
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/bench_parallel.py muon --preset tiny
"""
from __future__ import annotations

import argparse
import time

import torch


def bench_planner(device: str) -> None:
    """The device plan (what EP runs per layer) against the step-by-step host construction, at K3 shapes."""
    from k3.parallel.planner import balanced_plan, plan_balanced_reference
    E, K, S = 896, 16, 4096
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"| ranks | routing | balanced_plan on {device} ms/layer | host reference ms/layer | max replicas/rank |")
    print("|---|---|---|---|---|")
    for R in (2, 8, 32, 64, 128):
        g = torch.Generator().manual_seed(R)
        for kind in ("zipf", "one-expert"):
            if kind == "zipf":
                w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
                load = torch.bincount(torch.multinomial(w, R * S * K, replacement=True, generator=g), minlength=E)
            else:
                load = torch.zeros(E, dtype=torch.long)
                load[3] = R * S * K
            on_dev = load.to(dev)
            balanced_plan(on_dev, R)
            plan_balanced_reference(load, R)
            n = 20
            sync()
            t = time.perf_counter()
            for _ in range(n):
                p = balanced_plan(on_dev, R)
            sync()
            td = (time.perf_counter() - t) / n * 1e3
            t = time.perf_counter()
            for _ in range(n):
                ref = plan_balanced_reference(load, R)
            tr = (time.perf_counter() - t) / n * 1e3
            assert p.to_plan().replicas == ref.replicas
            print(f"| {R} | {kind} | {td:.3f} | {tr:.3f} | {max(len(r) for r in ref.replicas)} |")


def _device() -> torch.device:
    """This rank's GPU, or the CPU (gloo) for a smoke run of the script itself."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timeit(fn, iters=20, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t) / iters


def bench_a2a(sizes_mib: list[int]) -> None:
    import torch.distributed as dist
    from k3.config import K3Config
    from k3.model.moe import LatentMoE
    from k3.parallel.expert_parallel import apply_expert_parallel
    from k3.parallel.mesh import init_distributed
    rank, world = init_distributed()
    dev = _device()
    cfg = K3Config.preset("kimi-k3")
    L, K = cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // 2
        x = torch.randn(n, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(x)
        t = _timeit(lambda: dist.all_to_all_single(out, x))
        bare = mib / 1024 / t
        # EP dispatch of the same bytes: S tokens × K slots × L latent × 2 B ≈ mib
        S = max(1, mib * 2**20 // (K * L * 2))
        small = K3Config.preset("kimi-k3").replace(num_experts=64 * world, num_experts_per_token=K,
                                                   moe_intermediate_size=256)
        with torch.device(dev):
            moe = LatentMoE(small).to(torch.bfloat16)
            for p in moe.parameters():
                torch.nn.init.normal_(p, std=0.02)
        handle = apply_expert_parallel(moe, None, "balanced")[0]
        z = torch.randn(S, L, dtype=torch.bfloat16, device=dev)
        idx = torch.rand(S, small.num_experts, device=dev).argsort(1)[:, :K]
        w = torch.full((S, K), 1.0 / K, dtype=torch.bfloat16, device=dev)
        t_ep = _timeit(lambda: handle(z, idx, w), iters=5, warmup=2)
        # the same without the expert GEMMs (each slot's row comes back as it went): planning, the count
        # all-gather, the one host read, the permutes, dispatch and combine, what the 80% target is about
        import k3.parallel.expert_parallel as ep_module
        real, ep_module.expert_situ_mlp = ep_module.expert_situ_mlp, lambda x, counts, *weights: x
        try:
            t_move = _timeit(lambda: handle(z, idx, w), iters=10, warmup=3)
        finally:
            ep_module.expert_situ_mlp = real
        moved = 2 * mib / 1024 / t_move
        rows.append((mib, bare, S, t_ep * 1e3, t_move * 1e3, moved, moved / bare))
    if rank == 0:
        print("| MiB | bare all_to_all_single GiB/s/rank | EP tokens | EP dispatch+GEMM+combine ms | "
              "EP dispatch+combine ms | EP GiB/s/rank (2 × MiB) | of bare |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.1f} | {r[6]:.0%} |")


def bench_train(ep: int, cp: int, steps: int, seq: int, batch: int, preset: str, recompute: bool) -> None:
    import torch.distributed as dist
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.parallel.mesh import ParallelDims, ParallelMesh, init_distributed
    from k3.parallel.parallelize import ParallelK3, clip_grad_norm_
    rank, world = init_distributed()
    dev = _device()
    torch.manual_seed(0)
    # bf16 weights (no autocast: the grouped expert GEMM wants one dtype for tokens and weights)
    with torch.device(dev):  # built in place: scale-out's 3.5B parameters initialise in seconds on a GPU
        model = K3ForCausalLM(K3Config.preset(preset)).to(torch.bfloat16)
    model.model.gradient_checkpointing = recompute
    runner = ParallelK3(model, ParallelMesh(ParallelDims(dp=world // cp, ep=ep, cp=cp))) if world > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev)

    def step():
        out = (runner or model)(ids, labels=ids)
        out.loss.backward()
        if runner:
            runner.sync_gradients()
            clip_grad_norm_(runner, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = _timeit(step, iters=steps, warmup=2)
    if rank == 0:
        print(f"| {preset} | gpus {world} | ep {ep} | cp {cp} | batch {batch}×{seq} | recompute {recompute} | "
              f"{batch * seq / t:,.0f} tokens/s |")
    if world > 1:
        dist.barrier()


def bench_muon(preset: str, steps: int) -> None:
    """Muon's step on replicated matrices (plain data parallel), per rank: Newton–Schulz time and the whole step,
    every rank orthogonalising every matrix against `spread_over` (one owner each, one all-gather)."""
    import torch.distributed as dist
    import k3.train.optim as optim
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.parallel.mesh import init_distributed
    rank, world = init_distributed()
    dev = _device()
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForCausalLM(K3Config.preset(preset))
    g = torch.Generator(device=dev).manual_seed(1)
    for p in model.parameters():  # the same gradients on every rank, as after the data-parallel all-reduce
        p.grad = torch.randn(p.shape, generator=g, device=dev)
    real, ns_time = optim.newton_schulz, [0.0]

    def timed(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        _sync()
        ns_time[0] += time.perf_counter() - t
        return out

    optim.newton_schulz = timed
    rows = {}
    try:
        for spread in (False, True):
            opt = optim.build_optimizer(model, "muon", lr=1e-5)
            muon = [p for grp in opt.param_groups if grp["use_muon"] for p in grp["params"]]
            if spread:
                opt.spread_over({p: None for p in muon})
            opt.step()  # warm-up (allocates the momentum)
            ns_time[0] = 0.0
            step = _timeit(opt.step, iters=steps, warmup=0)
            mine = torch.tensor([ns_time[0] / steps * 1e3, step * 1e3], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            rows[spread] = (len(muon), sum(p.numel() for p in muon), torch.stack(every))
    finally:
        optim.newton_schulz = real
    if rank == 0:
        n, numel, alone = rows[False]
        print(f"{preset}: {n} Muon matrices, {numel / 1e6:.2f} M elements, {world} ranks, device {dev.type}")
        print("| Muon step | Newton–Schulz ms/step/rank (max, min over ranks) | step ms (max) |")
        print("|---|---|---|")
        for spread, label in ((False, "every rank orthogonalises all (before)"), (True, "spread_over (ours)")):
            t = rows[spread][2]
            print(f"| {label} | {t[:, 0].max():.1f}, {t[:, 0].min():.1f} | {t[:, 1].max():.1f} |")
        print(f"| ideal: before / {world} ranks, no communication | {alone[:, 0].max() / world:.1f} | "
              f"{alone[:, 1].max() - alone[:, 0].max() * (1 - 1 / world):.1f} |")
    dist.barrier()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["planner", "a2a", "train", "muon"])
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--mib", default="16,128,512", help="a2a: buffer sizes per rank")
    ap.add_argument("--device", default="cpu", help="planner: where the device plan runs")
    ap.add_argument("--preset", default="small", help="train: the model (scale-out: the preset meant for 2-4 GPUs)")
    ap.add_argument("--recompute", action="store_true", help="train: activation checkpointing (per layer)")
    a = ap.parse_args()
    if a.part == "planner":
        bench_planner(a.device)
    elif a.part == "a2a":
        bench_a2a([int(m) for m in a.mib.split(",")])
    elif a.part == "muon":
        bench_muon(a.preset, a.steps)
    else:
        bench_train(a.ep, a.cp, a.steps, a.seq, a.batch, a.preset, a.recompute)
