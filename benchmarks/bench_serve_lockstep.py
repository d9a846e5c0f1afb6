"""What keeping N serving ranks in lockstep costs per engine step (k3.serve.distributed), on this machine's gloo.

Every step rank 0 publishes what changed since the last one (new requests, aborts) to the other ranks, and after
sampling its sampled ids replace theirs. Rows, medians over --steps steps on --nproc gloo ranks (µs):
  floor              one all_reduce of one integer: the least any per-step synchronisation costs here
  publish, nothing   a decode step with no new request: the events broadcast carries an empty list
  publish, 8 × 512   eight new requests of 512-token prompts arriving before one step
  agree, 64 ids      rank 0's 64 sampled ids broadcast over the token group
  decode step total  publish (nothing) + agree (64 ids): the lockstep's share of a decode step
On GPUs the control messages stay on gloo (host memory, no device sync) and the ids go over NCCL.
Run: OMP_NUM_THREADS=1 python benchmarks/bench_serve_lockstep.py [--nproc 2] [--steps 500]
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

from k3.serve.distributed import Lockstep, ServeLayout, make_groups
from k3.serve.sampling import SamplingParams


def _timed(fn, steps: int) -> float:
    """Median µs of fn() over steps calls, the ranks lined up by a barrier before each."""
    out = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def _rank(rank: int, world: int, port: int, steps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    channel = Lockstep(make_groups(ServeLayout(world, world), rank))
    lead = rank == 0
    one = torch.ones(1, dtype=torch.long)
    ids = torch.zeros(64, dtype=torch.long)
    params = SamplingParams(max_tokens=256, temperature=0.7, logprobs=1)
    arrivals = [("add", list(range(512)), params, f"req-{i}", None, None, None) for i in range(8)]

    def send(events):
        return (lambda: channel.publish(events)) if lead else channel.receive

    rows = {"floor": _timed(lambda: dist.all_reduce(one), steps),
            "publish, nothing": _timed(send([]), steps),
            "publish, 8 × 512": _timed(send(arrivals), steps),
            "agree, 64 ids": _timed(lambda: channel.agree(ids), steps),
            "decode step total": _timed(lambda: (send([])(), channel.agree(ids)), steps)}
    torch.save(rows, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(a.nproc, port, a.steps, out_dir), nprocs=a.nproc, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(a.nproc)]
    print(f"| per step, {a.nproc} gloo ranks, median of {a.steps} | rank 0 µs | slowest other rank µs |")
    print("|---|---:|---:|")
    for name in ranks[0]:
        print(f"| {name} | {ranks[0][name]:.0f} | {max(r[name] for r in ranks[1:]):.0f} |")


if __name__ == "__main__":
    main()
