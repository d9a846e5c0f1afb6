"""Distributed serving on 2 GPUs over NCCL against one GPU (float32): the lockstep engine with experts sharded 2
ways (float32, and MXFP4 kept packed beside 2-way tensor parallelism), its decode-only steps replayed from CUDA
graphs with the expert all-reduce captured inside them (greedy tokens, prefix hits and preemptions equal,
logprobs close). The workload and checks are test_serve_distributed's; marked `gpu`, skipped with fewer than 2
GPUs."""
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3 import K3ForCausalLM
from k3.data import Tokenizer
from k3.serve import LLMEngine
from serve_distributed_job import assert_same_serving, engine_config, rank_job, save_models, workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
LAYOUTS = [(2, 1, False), (2, 2, True)]


def _entry(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(rank_job(rank, world, model_dir, LAYOUTS, f"cuda:{rank}"), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("served"))


def test_two_gpus_equal_one(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(2, port, out_dir, str(model_dir)), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(2)]
    for i, (_, _, mxfp4) in enumerate(LAYOUTS):
        d = model_dir / ("mxfp4" if mxfp4 else "f32")
        model = K3ForCausalLM.from_pretrained(d, device="cuda", packed_experts=mxfp4).eval()
        want = workload(LLMEngine(model, Tokenizer.from_file(), engine_config()))
        assert_same_serving(results[0][i][0], want, atol=1e-3)
        assert results[0][i][1]["captured_graphs"] > 0 and results[1][i][1]["captured_graphs"] > 0
