"""Shared pieces of the multi-process parallel tests: a gloo launcher (spawned processes kept for the next
launch of the same world size; each worker returns a picklable result) and the reference model every rank
builds identically."""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3 import K3Config, K3ForCausalLM
from random_model import randomize_trivial_parts


def tiny_config(**changes) -> K3Config:
    """The tiny preset with a small vocabulary (6 layers: KDA, MLA at 3 and 5, MoE 16 experts top-4)."""
    return K3Config.preset("tiny").replace(vocab_size=97, **changes)


def make_model(seed: int = 0, config: K3Config | None = None, hot_experts: list[int] | None = None) -> K3ForCausalLM:
    """Float64 model with every trivially-initialised part randomised (AttnRes queries, A_log, router bias).
    hot_experts: experts whose router bias is raised so that every token picks them (adversarial routing)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config or tiny_config())
    model.reset_parameters(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    randomize_trivial_parts(model, g, bias_scale=0.01)
    if hot_experts:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b[hot_experts] += 10.0
    return model.double()


def batch(seed: int, B: int, T: int, vocab: int = 97, docs: bool | str = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[:, -1] = -100
    out = {"input_ids": ids, "labels": labels}
    if docs == "one":  # every row one document (a long document's rows): the shards attend without packing
        out["doc_ids"] = torch.zeros(B, T, dtype=torch.long)
    elif docs:  # a few documents per row, boundaries at random places
        cuts = (torch.rand(B, T, generator=g) < 0.2).long()
        cuts[:, 0] = 0
        out["doc_ids"] = cuts.cumsum(1)
    return out


class _Group:
    """`world` spawned gloo processes, kept for every launch of that world size: starting one (a fresh interpreter
    importing torch and k3 on each rank) costs several seconds a process, far more than most tests' work, and the
    suite launches about fifteen times. Each job runs on every rank in the same process group, with torch's
    generator and the environment reset to the launch's (a fresh process's view); a job that fails on any rank,
    or a rank that dies, ends the group (a rank left waiting in a collective cannot be reused)."""

    def __init__(self, world: int, key):
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.world, self.key, self.done = world, key, ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.jobs[r], self.done, os.getpid()))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, args: tuple) -> list:
        job = pickle.dumps((fn, args, dict(os.environ)))  # here, so that an unpicklable job fails in the caller
        with tempfile.TemporaryDirectory() as out_dir:
            for q in self.jobs:
                q.put((job, out_dir))
            pending = set(range(self.world))
            while pending:
                try:
                    rank, error = self.done.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead:
                        self.close()
                        raise RuntimeError(f"gloo rank(s) {dead} died (exit codes "
                                           f"{[self.procs[r].exitcode for r in dead]})") from None
                    continue
                if error is not None:
                    self.close()
                    raise RuntimeError(f"rank {rank} failed:\n{error}")
                pending.discard(rank)
            return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(self.world)]

    def close(self) -> None:
        """Ends the processes (politely when idle, by force when a job left them stuck) and forgets the group."""
        if _GROUPS.get(self.key) is self:
            del _GROUPS[self.key]
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_GROUPS: dict = {}  # (world, start-time environment) -> _Group


def _serve(rank: int, world: int, port: int, jobs, done, parent: int) -> None:
    torch.set_num_threads(1)
    fresh_rng = torch.get_rng_state()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        try:
            item = jobs.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone: nobody will send work
                return
            continue
        if item is None:
            dist.destroy_process_group()
            return
        job, out_dir = item
        try:
            fn, args, env = pickle.loads(job)
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(1)
            torch.set_rng_state(fresh_rng)
            torch.save(fn(rank, world, *args), os.path.join(out_dir, f"{rank}.pt"))
            done.put((rank, None))
        except BaseException:  # reported, then this rank stops: the group is not reused after a failure
            done.put((rank, traceback.format_exc()))
            return


# variables a process reads once, at start or import (k3.envs, OpenMP, torch): a launch under other values of them
# needs fresh processes
_READ_AT_START = ("K3_", "OMP_", "GOMP_", "MKL_", "TORCH", "CUDA")


def launch(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) on `world` gloo processes; returns the ranks' results in rank order. The
    processes are kept for the next launch of the same world size and start-time environment (see _Group)."""
    key = (world, frozenset((k, v) for k, v in os.environ.items() if k.startswith(_READ_AT_START)))
    if key not in _GROUPS:
        _GROUPS[key] = _Group(world, key)
    return _GROUPS[key].run(fn, args)


@atexit.register
def _close_groups() -> None:
    for group in list(_GROUPS.values()):
        group.close()
