"""Tensor parallelism on 2 GPUs over NCCL against one GPU (float32): the plain forward, StaticCache decode, and
the serving engine whose decode-only steps replay CUDA graphs with the TP collectives captured inside them
(greedy tokens equal, logprobs close). The checks are test_tensor_parallel's; marked `gpu`, skipped with fewer
than 2 GPUs."""
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.parallel.tensor_parallel import apply_tensor_parallel
from test_tensor_parallel import forward_checks, make_model, serve_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def on_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_cpu(v) for v in x)
    return x


def _entry(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        model = apply_tensor_parallel(make_model().cuda())
        res = {"forward": forward_checks(model), "serve": serve_checks(model)}
        torch.save(on_cpu(res), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gpus_equal_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(2, port, out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(2)]
    model = make_model().cuda()
    ref = on_cpu({"forward": forward_checks(model), "serve": serve_checks(model)})
    for res in results:
        for key in ("logits", "packed", "static"):
            torch.testing.assert_close(res["forward"][key], ref["forward"][key], rtol=1e-4, atol=1e-4)
        assert torch.equal(res["forward"]["generate"], ref["forward"]["generate"])
        assert res["serve"]["preemptions"] > 0 and res["serve"]["captured_graphs"] > 0
        for got, want in zip(res["serve"]["requests"], ref["serve"]["requests"], strict=True):
            assert got["tokens"] == want["tokens"] and got["restored"] == want["restored"]
            torch.testing.assert_close(torch.tensor(got["lps"]), torch.tensor(want["lps"]), rtol=0, atol=1e-3)
