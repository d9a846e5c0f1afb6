"""EP plans on the device: one expert-parallel combine (2 gloo processes, skewed routing that forces replicas,
and the plain mode) reads the host once per call (its split lists) and runs no op that would stall a GPU
stream (nonzero, .item(), bincount, boolean-mask indexing, repeat_interleave without an output size), while
its output and gradients equal the single-process layer's."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.model.moe import LatentMoE
from k3.parallel.expert_parallel import apply_expert_parallel
from parallel_harness import launch, tiny_config

N_TOKENS = 12  # per rank


class SyncWatch(TorchDispatchMode):
    """Records every op that makes a CUDA device wait for the host (or the host for the device)."""

    def __init__(self):
        super().__init__()
        self.syncing = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.bincount", "aten.unique",
                    "aten._unique2", "aten.unique_consecutive"):
            self.syncing.append(name)
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.syncing.append("repeat_interleave without output_size")
        if name in ("aten.index", "aten.index_put", "aten.index_put_"):
            if any(t is not None and t.dtype == torch.bool for t in args[1]):
                self.syncing.append("boolean-mask indexing")
        return func(*args, **kwargs)


def layer(seed=0) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(tiny_config()).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def inputs(rank: int):
    """Latent tokens and a skewed top-4 routing: most slots go to experts 0-3, all homed on rank 0."""
    g = torch.Generator().manual_seed(10 + rank)
    z = torch.randn(N_TOKENS, layer().experts.w1.shape[2], generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(N_TOKENS)])
    idx[: N_TOKENS - 2] = torch.tensor([0, 1, 2, 3])
    w = torch.rand(N_TOKENS, 4, generator=g, dtype=torch.float64)
    return z, idx, w


def worker(rank, world):
    res = {}
    for mode in ("balanced", "plain"):
        moe = layer()
        handle = apply_expert_parallel(moe, None, mode)[0]
        z, idx, w = inputs(rank)
        z.requires_grad_(True)
        reads = []
        real_tolist = torch.Tensor.tolist

        def counted_tolist(t):
            if sys._getframe(1).f_code.co_filename.endswith("expert_parallel.py"):
                reads.append(t.numel())
            return real_tolist(t)

        torch.Tensor.tolist = counted_tolist
        try:
            with SyncWatch() as watch:
                out = handle(z, idx, w)
        finally:
            torch.Tensor.tolist = real_tolist
        out.pow(2).sum().backward()
        res[mode] = {"out": out.detach(), "z_grad": z.grad, "w1_grad": moe.experts.w1.grad.clone(),
                     "reads": reads, "syncing": watch.syncing, "replicas": handle.last_plan.replicas}
    res["overlap"] = overlap_order(rank)
    return res


def overlap_order(rank):
    """The order of events when the shared experts are handed to the combine: each all-to-all launch (async or
    not), the shared experts' call, and each wait on an async exchange; plus the combine's two results."""
    moe = layer()
    handle = apply_expert_parallel(moe, None, "balanced")[0]
    z, idx, w = inputs(rank)
    events = []
    real = torch.distributed.all_to_all_single

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def spy(*args, async_op=False, **kwargs):
        events.append("launch async" if async_op else "launch")
        work = real(*args, async_op=async_op, **kwargs)
        return Work(work) if async_op else work

    torch.distributed.all_to_all_single = spy
    try:
        out, extra = handle(z, idx, w, meanwhile=lambda: events.append("shared") or z.sum())
    finally:
        torch.distributed.all_to_all_single = real
    return {"events": events, "out": out, "extra": extra, "plain": handle(z, idx, w)}


@pytest.fixture(scope="module")
def results(single_thread):
    return launch(worker, 2)


@pytest.mark.parametrize("mode", ["balanced", "plain"])
def test_one_host_read_and_no_stalling_op_per_call(results, mode):
    for res in results:
        assert res[mode]["syncing"] == []
        assert res[mode]["reads"] == [4 * 2]  # one read: send, receive, replica counts and donors of 2 ranks
    if mode == "balanced":  # the skew made rank 1 replicate rank 0's hot experts: the fetch path ran too
        assert results[0][mode]["replicas"][1] != []


@pytest.mark.parametrize("mode", ["balanced", "plain"])
def test_output_and_gradients_equal_one_process(results, mode):
    moe = layer()
    for rank, res in enumerate(results):
        z, idx, w = inputs(rank)
        z.requires_grad_(True)
        out = moe.combine_experts(z, idx, w)
        out.pow(2).sum().backward()
        torch.testing.assert_close(res[mode]["out"], out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[mode]["z_grad"], z.grad, rtol=1e-12, atol=1e-12)
    w1_grad = moe.experts.w1.grad  # summed over both ranks' tokens
    torch.testing.assert_close(torch.cat([res[mode]["w1_grad"] for res in results]), w1_grad, rtol=1e-10, atol=1e-12)


def test_shared_experts_run_while_the_dispatch_travels(results):
    """The dispatch and the replica fetch are launched async, the shared experts are queued before their waits,
    the combine comes after;
    and handing them over changes neither result."""
    for rank, res in enumerate(results):
        o = res["overlap"]
        # dispatch and replica fetch (the skew makes replicas) in flight, shared experts, both waits, combine
        assert o["events"] == ["launch async", "launch async", "shared", "wait", "wait", "launch"]
        torch.testing.assert_close(o["out"], o["plain"], rtol=0, atol=0)
        assert torch.equal(o["extra"], inputs(rank)[0].sum())
