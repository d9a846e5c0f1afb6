"""The context-parallel halo and sequence gather on 4 gloo processes, with shards shorter than the halo (a
halo spanning three earlier ranks, and zeros before the sequence start): values and gradients equal slicing
the whole sequence, built from slices alone (no index tensor made on the host and copied over)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.parallel.context_parallel import ContextParallelState
from parallel_harness import launch

WIDTH, B, C = 3, 2, 5
LENGTHS = (6, 13)  # over 4 ranks: shards of 2, 2, 1, 1 tokens, and of 4, 3, 3, 3


class IndexWatch(TorchDispatchMode):
    """Records gathers by an index tensor and tensors made from host data."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in ("aten.index", "aten.index_select", "aten.lift_fresh", "aten.gather"):
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def sequence(T: int) -> torch.Tensor:
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(T), dtype=torch.float64)


def weights() -> torch.Tensor:
    """Loss weights of the halo rows, different per position, so that the gradient says which row went where."""
    return torch.arange(1, B * WIDTH * C + 1, dtype=torch.float64).view(B, WIDTH, C) / 7


def worker(rank, world):
    cp = ContextParallelState(None)
    res = {}
    for T in LENGTHS:
        s, e = cp.begin(T, None)
        x = sequence(T)[:, s:e].clone().requires_grad_(True)
        with IndexWatch() as watch:
            halo = cp.halo(x, WIDTH)
            whole = cp.gather_sequence(x)
        ((halo * weights()).sum() + (whole * whole).sum()).backward()
        res[T] = {"halo": halo.detach(), "whole": whole.detach(), "grad": x.grad, "seen": watch.seen}
    return res


@pytest.fixture(scope="module")
def results(single_thread):
    return launch(worker, 4)


@pytest.mark.parametrize("T", LENGTHS)
def test_halo_and_gather_equal_slices_of_the_sequence(results, T):
    from k3.parallel.context_parallel import shard_bounds
    full = sequence(T)
    padded = torch.cat([torch.zeros(B, WIDTH, C, dtype=torch.float64), full], dim=1)
    # every rank's halo loss reaches the rows it read: d/dx of Σ w·halo over ranks, plus 2x from Σ whole² × 4
    want_grad = 4 * 2 * full.clone()
    for rank, (s, e) in enumerate(shard_bounds(T, 4)):
        res = results[rank][T]
        torch.testing.assert_close(res["halo"], padded[:, s:s + WIDTH], rtol=0, atol=0)
        torch.testing.assert_close(res["whole"], full, rtol=0, atol=0)
        for i, p in enumerate(range(s - WIDTH, s)):
            if p >= 0:
                want_grad[:, p] += weights()[:, i]
    for rank, (s, e) in enumerate(shard_bounds(T, 4)):
        torch.testing.assert_close(results[rank][T]["grad"], want_grad[:, s:e], rtol=1e-12, atol=1e-12)


def test_no_index_tensor_is_built(results):
    for res in results:
        for T in LENGTHS:
            assert res[T]["seen"] == []
