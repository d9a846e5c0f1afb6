"""Shared pieces of the multi-process parallel tests: a gloo launcher (torch.multiprocessing spawn; each
worker returns a picklable result) and the reference model every rank builds identically."""
from __future__ import annotations

import os
import socket
import tempfile

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


def batch(seed: int, B: int, T: int, vocab: int = 97, docs: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[:, -1] = -100
    out = {"input_ids": ids, "labels": labels}
    if docs:  # a few documents per row, boundaries at random places
        cuts = (torch.rand(B, T, generator=g) < 0.2).long()
        cuts[:, 0] = 0
        out["doc_ids"] = cuts.cumsum(1)
    return out


def _entry(rank: int, fn, world: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) on `world` gloo processes; returns the ranks' results in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(fn, world, port, out_dir, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]
