"""k3.ops.slot_rows: a step's rows of the serving pool's KDA states and short-conv tails. The references index the
pool (every row); the kernels (k3.ops._slot_rows_triton, on CUDA by default since session 24) move only the rows
before a device count, so a CUDA graph captured over a fixed-shape layout (StaticKDAView: real rows, a pad
document, empty ones on the scratch slot) moves only the replayed step's rows. Checked against the references on random pools and slots (without
CUDA: on CPU tensors under the Triton interpreter, where triton is installed), under a graph replayed with other
counts, slots and rows, and through the engine (tokens and logprobs equal)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from k3 import K3Config, K3ForCausalLM, envs
from k3.ops.slot_rows import gather_slots, scatter_slots_
from k3.serve import SamplingParams
from test_serve_engine import GREEDY, model  # noqa: F401
from test_serve_prefill_graphs import ARRIVALS, assert_same, drive, make

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KERNELS = dict(triton_opt_in="_slot_rows_triton")
SHAPES = [((9, 3, 8, 8), torch.float32), ((7, 3, 40), torch.bfloat16), ((6, 2, 2051), torch.float32)]


def case(shape, rows_dtype, device, seed, n):
    """A pool, S = n + 3 slots (n distinct real ones, then the scratch slot, the last, three times) and rows."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(shape, generator=g).to(device)
    P = shape[0]
    slots = torch.cat([torch.randperm(P - 1, generator=g)[:n], torch.full((3,), P - 1)]).to(device)
    rows = torch.randn(n + 3, *shape[1:], generator=g).to(device, rows_dtype)
    return pool, slots, rows


def test_references_move_every_row_whatever_the_count():
    """On a CPU (no kernel) the count is a hint the references need not take: every row moves."""
    pool, slots, rows = case((8, 2, 5), torch.float32, "cpu", 0, 4)
    count = torch.tensor(2)
    assert torch.equal(gather_slots(pool, slots, count), pool[slots])
    want = pool.clone()
    want[slots] = rows
    scatter_slots_(pool, slots, rows, count)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("shape,rows_dtype", SHAPES)
@pytest.mark.parametrize("seed", [1, 2])
def test_kernels_move_the_rows_before_the_count_and_nothing_else(shape, rows_dtype, seed):
    pytest.importorskip("triton")
    from k3.ops import _slot_rows_triton as kernels
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = shape[0] - 3
    pool, slots, rows = case(shape, rows_dtype, dev, seed, n)
    count = torch.tensor(n + 1, device=dev)  # the real rows and the first scratch row (a pad document's)
    flat = pool.view(pool.shape[0], -1)
    got = torch.full((n + 3, flat.shape[1]), float("nan"), device=dev)  # a gather's rows: the pool's dtype
    kernels.move_rows(flat, got, slots, count, to_pool=False)
    assert torch.equal(got[:n + 1], flat[slots[:n + 1]])
    assert got[n + 1:].isnan().all()  # past the count: not touched
    kernels.move_rows(flat, got, slots, None, to_pool=False)  # no count: every row
    assert torch.equal(got, flat[slots])
    before = pool.clone()
    kernels.move_rows(flat, rows.view(n + 3, -1), slots, count, to_pool=True)
    want = before.clone()
    want[slots[:n + 1]] = rows[:n + 1].to(pool.dtype)  # the rows past the count never reach the pool
    assert torch.equal(pool, want)


@cuda
def test_the_dispatch_takes_the_kernels_where_opted_in_on_cuda():
    pool, slots, rows = case((9, 3, 8, 8), torch.float32, "cuda", 7, 6)
    count = torch.tensor(7, device="cuda")
    with envs.override(**KERNELS):
        assert torch.equal(gather_slots(pool, slots, count)[:7], pool[slots[:7]])
        before = pool.clone()
        scatter_slots_(pool, slots, rows, count)
    want = before.clone()
    want[slots[:7]] = rows[:7]
    assert torch.equal(pool, want)  # the scratch slot (rows 7, 8) untouched: the kernels ran, not the reference


@cuda
def test_a_captured_gather_and_scatter_follow_the_count_slots_and_rows_refilled_in_place():
    shape = (12, 3, 8, 8)
    pool, slots, rows = case(shape, torch.float32, "cuda", 3, 6)
    count = torch.tensor(7, device="cuda")
    out = torch.empty_like(rows)
    with envs.override(**KERNELS):
        gather_slots(pool, slots, count)  # compile outside the capture
        scatter_slots_(pool.clone(), slots, rows, count)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(gather_slots(pool, slots, count))
            scatter_slots_(pool, slots, rows * 2, count)
    for seed, n in ((4, 2), (5, 6), (6, 0)):
        new_pool, new_slots, new_rows = case(shape, torch.float32, "cuda", seed, 6)
        pool.copy_(new_pool)
        slots.copy_(new_slots)
        rows.copy_(new_rows)
        count.fill_(n)
        before = pool.clone()
        graph.replay()
        assert torch.equal(out[:n], before[slots[:n]])
        want = before.clone()
        want[slots[:n]] = 2 * rows[:n]
        assert torch.equal(pool, want)


@cuda
def test_the_engine_with_the_kernels_serves_what_it_serves_without_them(model):
    """bf16 on CUDA, the static KDA layout (its empty documents then skipped): tokens, sampled and prompt logprobs
    equal with and without the kernels (they move the same bytes)."""
    m = K3ForCausalLM(K3Config.preset("tiny")).eval()
    m.load_state_dict(model.state_dict())
    m = m.cuda().bfloat16()
    greedy = [(p, SamplingParams(max_tokens=params.max_tokens, logprobs=2, prompt_logprobs=params.prompt_logprobs,
                                 **GREEDY), at) for p, params, at in ARRIVALS]
    runs = []
    for switches in (KERNELS, {}):
        with envs.override(**switches), torch.inference_mode():
            eng = make(m, True, static_kda_cores=True)
            assert eng.runner.prefill_graphs.kda_view is not None
            runs.append(drive(eng, greedy)[0])
    for a, b in zip(*runs):
        assert_same(a, b, tol=1e-6)
