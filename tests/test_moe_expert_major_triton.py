"""Decode's routed experts expert by expert (k3.ops._moe_expert_major_triton, the custom op k3::moe_expert_major)
against `selected_experts_situ_mlp_reference` in float64: batch sizes 1..64, top-k 1..8, widths that are no
multiple of the tiles, slots held by another rank (ids < 0) and ids past the stack, a token picking one expert
more than once, every token on one expert; the weight tiles each expert reads (once per 16 of its slots, none
for an expert nobody chose); the selector; the op under torch.compile; the combine's tail (the routed norm and the
shared SiTU-GLU in its launch) against the three ops apart; a tiny model's batched decode through it against the
full forward. On CUDA where there is one, else on the CPU under the Triton interpreter; skipped
where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from kernel_launches import record_launches  # noqa: E402

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops import _moe_expert_major_triton as kernels  # noqa: E402
from k3.ops import gemv  # noqa: E402
from k3.ops.gemv import force_gemv  # noqa: E402
from k3.ops.moe_decode import (EXPERT_MAJOR_MAX_SLOTS, force_expert_major, selected_experts_situ_mlp,  # noqa: E402
                               selected_experts_situ_mlp_reference, selected_experts_tail,
                               selected_experts_tail_reference, use_expert_major)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    a, b = a.cpu().double(), b.cpu().double()
    return ((a - b).norm() / b.norm()).item()


def case(N, k, E, L, I, seed, idx=None):
    """z [N, L], ids [N, k] (random distinct experts a token unless given), routing weights, w1, w3, w2."""
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g) / L ** 0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g) / I ** 0.5
    z = torch.randn(N, L, generator=g) * 2
    if idx is None:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    wt = torch.rand(N, k, generator=g)
    return z, idx, wt, w1, w3, w2


def run(z, idx, wt, w1, w3, w2, dtype=torch.float32):
    """The kernel on `dtype` copies (the routing weights too, as LatentMoE passes them), and the float64 reference
    of those same rounded inputs."""
    args = [t.to(DEVICE, dtype) for t in (z, wt, w1, w3, w2)]
    z_, wt_, w1_, w3_, w2_ = args
    out = kernels.expert_major_situ_mlp(z_, idx.to(DEVICE), wt_, w1_, w3_, w2_, 4.0, 25.0)
    want = selected_experts_situ_mlp_reference(*(t.cpu().double() if t.is_floating_point() else t.cpu()
                                                 for t in (z_, idx, wt_, w1_, w3_, w2_)))
    return out, want


@pytest.mark.parametrize("N,k,E,L,I", [
    (1, 8, 16, 48, 64),  # one token, 8 of 16 experts
    (7, 3, 8, 40, 72),  # odd widths, most experts shared by several tokens
    (33, 2, 16, 24, 40),  # 66 slots: experts with more than 16 slots (two row blocks)
    (64, 8, 32, 48, 40),  # small's batch and top-k: 512 slots over 32 experts
    (5, 1, 4, 130, 17),  # top-1; L past two 64-wide tiles, I narrower than one
])
def test_kernel_equals_the_reference(N, k, E, L, I):
    z, idx, wt, w1, w3, w2 = case(N, k, E, L, I, seed=N * 100 + k)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert out.shape == (N, L) and out.dtype == torch.float32
    assert rel_err(out, want) < 1e-5
    if DEVICE == "cuda":  # (the interpreter runs the programs one by one)
        again, _ = run(z, idx, wt, w1, w3, w2)
        assert torch.equal(out, again)  # no atomics: the same bits on every run


def test_z_may_be_a_column_slice():
    """z as LatentMoE hands it at decode: a slice of the fused input projection's output (rows strided), read in
    place with the contiguous copy's answer."""
    z, idx, wt, w1, w3, w2 = (t.to(DEVICE) for t in case(7, 3, 8, 40, 72, seed=4))
    wide = torch.cat([torch.full_like(z, float("nan")), z, torch.full_like(z, float("nan"))], 1)[:, 40:80]
    assert not wide.is_contiguous() and torch.equal(wide, z)
    out = kernels.expert_major_situ_mlp(wide, idx, wt, w1, w3, w2, 4.0, 25.0)
    assert torch.equal(out, kernels.expert_major_situ_mlp(z, idx, wt, w1, w3, w2, 4.0, 25.0))
    want = selected_experts_situ_mlp_reference(z.cpu().double(), idx.cpu(), wt.cpu().double(), w1.cpu().double(),
                                               w3.cpu().double(), w2.cpu().double())
    assert rel_err(out.cpu(), want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_accumulate_in_fp32(dtype):
    """h is rounded to the model's dtype as the reference rounds it; the sums are fp32 (within a 16-bit rounding
    of the float64 reference of the same rounded inputs, where 16-bit sums over 48-80 terms would not be)."""
    z, idx, wt, w1, w3, w2 = case(33, 4, 16, 48, 80, seed=3)
    out, want = run(z, idx, wt, w1, w3, w2, dtype)
    assert out.dtype == dtype
    assert rel_err(out, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_other_ranks_slots_repeated_experts_and_ids_past_the_stack():
    """ids < 0 (held by another rank) and ids ≥ E (nobody's) add nothing, read nothing and leave no unwritten
    memory in the sum, even with a NaN routing weight; a token picking expert 2 three times gets it three times."""
    E = 6
    idx = torch.tensor([[2, 2, 2], [-1, 4, 0], [5, -1, -7], [E, 1, 10 ** 12], [3, 3, -1]])
    z, _, wt, w1, w3, w2 = case(5, 3, E, 40, 24, seed=7, idx=idx)
    wt[1, 0] = wt[2, 1] = wt[3, 0] = float("nan")  # weights of slots that are not computed here
    out = kernels.expert_major_situ_mlp(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0)
    mine = (idx >= 0) & (idx < E)
    want = selected_experts_situ_mlp_reference(z.double(), torch.where(mine, idx, 0),
                                               torch.where(mine, wt, 0).double(), w1.double(), w3.double(),
                                               w2.double())
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < 1e-5
    # the reference's own contract for ids < 0 is the same sum (rows 1, 2 and 4 hold only ids < E)
    ref = selected_experts_situ_mlp_reference(z[[1, 2, 4]].double(), idx[[1, 2, 4]], wt[[1, 2, 4]].double(),
                                              w1.double(), w3.double(), w2.double())
    assert rel_err(out[[1, 2, 4]], ref) < 1e-5
    # the three picks of expert 2 are three times one pick
    one = selected_experts_situ_mlp_reference(z[:1].double(), idx[:1, :1], wt[:1].sum(1, keepdim=True).double(),
                                              w1.double(), w3.double(), w2.double())
    assert rel_err(out[:1], one) < 1e-5


@pytest.mark.parametrize("k", [1, 3])
def test_every_token_on_one_expert(k):
    """33 tokens × k slots on expert 1 of 8 (k > 1: the same expert k times a token): 33 rows in passes of 16,
    and 99 in passes of 32 (more than 12 slots an expert on average)."""
    idx = torch.ones(33, k, dtype=torch.long)
    assert kernels.block_m(33 * k, 8) == (16 if k == 1 else 32)
    z, _, wt, w1, w3, w2 = case(33, k, 8, 40, 72, seed=k, idx=idx)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert rel_err(out, want) < 1e-5


def test_passes_of_32_slots_from_the_launch_threshold(monkeypatch):
    """LAUNCH["wide_m_from"] (what the MoE sweep varies) sets where a pass takes 32 slots: at 0 even a few slots an
    expert go in passes of 32, and the result is the reference's."""
    monkeypatch.setitem(kernels.LAUNCH, "wide_m_from", 0)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    assert kernels.block_m(idx.numel(), 8) == 32
    z, _, wt, w1, w3, w2 = case(3, 2, 8, 40, 72, seed=4, idx=idx)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("N", [7, 8])
def test_down_takes_wide_w2_tiles_from_the_launch_threshold(N, monkeypatch):
    """From LAUNCH["wide_l_from"] (4) slots an expert on average, down's programs take 128 rows of W2 each (across
    L = 200: two programs an expert, the second cut at the edge) instead of 64 (four); either way the result is the
    reference's. N = 7 tokens × top-4 over 8 experts is 3.5 slots an expert, N = 8 is 4."""
    launched = record_launches(monkeypatch, kernels, "_down_kernel")
    E, L, I = 8, 200, 48
    rows_l = 128 if N * 4 >= 4 * E else 64
    assert kernels.down_block_l(N * 4, E) == rows_l
    z, idx, wt, w1, w3, w2 = case(N, 4, E, L, I, seed=N)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert rel_err(out, want) < 1e-5
    assert [(grid, meta["BLOCK_L"]) for _, grid, _, meta in launched] == [((E, -(-L // rows_l), 1), rows_l)]


@pytest.mark.parametrize("k,split_from", [(1, 0), (3, 0), (3, 1 << 20)])
def test_two_programs_take_turns_at_an_experts_passes(k, split_from, monkeypatch):
    """From LAUNCH["split_passes_from"] slots an expert on average, each (expert, block) gets two programs taking
    turns at its passes (0, 2, 4, … and 1, 3, 5, …): 33 tokens × k on expert 1 of 8 is 3 passes of 16 (k = 1) or 4
    of 32 (k = 3: passes past the two programs' first turn); either way the reference's result, and the launches
    carry that many programs a block."""
    monkeypatch.setitem(kernels.LAUNCH, "split_passes_from", split_from)
    launched = record_launches(monkeypatch, kernels, "_gate_up_kernel", "_down_kernel")
    idx = torch.ones(33, k, dtype=torch.long)
    idx[::5, 0] = 6  # a second, lighter expert, and experts nobody chose
    z, _, wt, w1, w3, w2 = case(33, k, 8, 40, 72, seed=k + 7, idx=idx)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert rel_err(out, want) < 1e-5
    split = 2 if split_from == 0 else 1
    assert kernels.passes(idx.numel(), 8) == split and [grid[2] for _, grid, _, _ in launched] == [split, split]


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's calls of a jitted helper (no seam in a "
                    "compiled kernel)")
@pytest.mark.parametrize("split_from", [1 << 20, 0])
def test_each_chosen_expert_tile_is_read_once_per_16_slots_and_no_other(split_from, monkeypatch):
    """A spy on `_dot` (one call per weight tile multiplied): gate+up read each chosen expert's W1 and W3 tiles,
    down its W2 tiles, once per 16 of its slots; an expert nobody chose is never read. The same with two programs
    taking turns at the passes (the second of a one-pass expert reads nothing)."""
    monkeypatch.setitem(kernels.LAUNCH, "split_passes_from", split_from)
    calls = []
    inner = kernels._dot

    def spy(a, b, *rest):
        calls.append(tuple(b.shape))
        return inner(a, b, *rest)

    monkeypatch.setattr(kernels, "_dot", spy)
    E, L, I = 12, 40, 72
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(0, 5, (9, 4), generator=g)  # experts 5..11 never chosen
    idx[:, :2] = 3  # expert 3: ≥ 18 slots, two row blocks (a token picks it twice)
    z, _, wt, w1, w3, w2 = case(9, 4, E, L, I, seed=9, idx=idx)
    out, want = run(z, idx, wt, w1, w3, w2)
    assert rel_err(out, want) < 1e-5
    p = kernels.LAUNCH
    assert kernels.block_m(idx.numel(), E) == 16
    counts = torch.bincount(idx.flatten(), minlength=E)
    blocks = (-(-counts // 16)).sum().item()  # row blocks over the chosen experts
    assert counts[3] > 16 and blocks == (counts > 0).sum().item() + 1
    gate_up = 2 * -(-I // p["gate_up_block_i"]) * -(-L // p["gate_up_block_l"])
    down = -(-L // p["down_block_l"]) * -(-I // p["down_block_i"])
    assert len(calls) == blocks * (gate_up + down)


@pytest.mark.parametrize("N,k,E,L,I,I_shared", [
    (6, 4, 16, 40, 24, 48),  # widths no multiple of the tiles
    (24, 8, 32, 96, 64, 1100),  # past 16 rows (where the step takes it), the GLU past one 1024-wide chunk
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_tail_equals_the_reference(N, k, E, L, I, I_shared, dtype, with_norm):
    """The combine's launch with the routed norm and the shared experts' SiTU-GLU (their gate and up column slices of
    one wider projection output, as LatentMoE's fused input projection gives them) against the three apart, in
    float64 from the same rounded inputs: fp32 to 1e-5; bf16 within the output's rounding (the kernel rounds the
    sum before its norm, as the module's rms_norm does, so the norm's input agrees to a bf16 ulp)."""
    z, idx, wt, w1, w3, w2 = case(N, k, E, L, I, seed=N + k + L)
    g = torch.Generator().manual_seed(N)
    fused_in = torch.randn(N, 3 + 2 * I_shared, generator=g) * 3  # [.., gate, up] slices, rows strided
    gate, up = fused_in[:, 3:3 + I_shared], fused_in[:, 3 + I_shared:]
    norm_w = torch.rand(L, generator=g) + 0.5 if with_norm else None
    z_, wt_, w1_, w3_, w2_, gate_, up_ = (t.to(DEVICE, dtype) for t in (z, wt, w1, w3, w2, gate, up))
    nw_ = None if norm_w is None else norm_w.to(DEVICE, dtype)
    with force_expert_major(True):
        got_r, got_h = selected_experts_tail(z_, idx.to(DEVICE), wt_, w1_, w3_, w2_, (4.0, 25.0), nw_, 1e-5, gate_,
                                             up_, (3.0, 20.0))
    f64 = [None if t is None else t.cpu().double() for t in (z_, wt_, w1_, w3_, w2_, nw_, gate_, up_)]
    want_r, want_h = selected_experts_tail_reference(f64[0], idx, *f64[1:5], (4.0, 25.0), f64[5], 1e-5, f64[6],
                                                     f64[7], (3.0, 20.0))
    assert got_r.shape == (N, L) and got_h.shape == (N, I_shared) and got_r.dtype == got_h.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert rel_err(got_h, want_h) < tol
    assert rel_err(got_r, want_r) < (1e-5 if dtype == torch.float32 else 2 ** -6)
    if with_norm:  # each row's rms is the norm weight's: the norm ran (not a plain sum)
        rms = (got_r.double() / nw_.double()).pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms.cpu(), torch.ones(N, dtype=torch.float64), rtol=2e-2, atol=0)


def test_tail_is_declined_where_its_inputs_do_not_fit(monkeypatch):
    """None (the caller runs the three apart) for GLU inputs that are not [N, I] rows with contiguous columns in
    z's dtype, a norm weight of another width, wherever the expert-major kernels would not take the call, and
    with the launch's `tail` off."""
    z, idx, wt, w1, w3, w2 = (t.to(DEVICE) for t in case(6, 4, 16, 40, 24, seed=2))
    gate = up = torch.zeros(6, 32, device=DEVICE)
    args = (z, idx, wt, w1, w3, w2, (4.0, 25.0))
    with force_expert_major(True):
        assert selected_experts_tail(*args, None, 1e-5, gate, up, (4.0, 25.0)) is not None
        assert selected_experts_tail(*args, None, 1e-5, gate.t().contiguous().t(), up, (4.0, 25.0)) is None
        assert selected_experts_tail(*args, None, 1e-5, gate, up[:, :16], (4.0, 25.0)) is None
        assert selected_experts_tail(*args, None, 1e-5, gate[:5], up[:5], (4.0, 25.0)) is None
        assert selected_experts_tail(*args, None, 1e-5, gate.double(), up.double(), (4.0, 25.0)) is None
        assert selected_experts_tail(*args, torch.ones(39, device=DEVICE), 1e-5, gate, up, (4.0, 25.0)) is None
        assert selected_experts_tail(z[:1], idx[:1], wt[:1], w1, w3, w2, (4.0, 25.0), None, 1e-5, gate[:1], up[:1],
                                     (4.0, 25.0)) is None  # 4 slots: the slot-major kernel's
    with force_expert_major(False):
        assert selected_experts_tail(*args, None, 1e-5, gate, up, (4.0, 25.0)) is None
    monkeypatch.setitem(kernels.LAUNCH, "tail", False)
    with force_expert_major(True):
        assert selected_experts_tail(*args, None, 1e-5, gate, up, (4.0, 25.0)) is None


def test_no_slots_gives_an_empty_sum():
    z, idx, wt, w1, w3, w2 = case(0, 4, 8, 40, 24, seed=1, idx=torch.zeros(0, 4, dtype=torch.long))
    out = kernels.expert_major_situ_mlp(z.to(DEVICE), idx.to(DEVICE), wt.to(DEVICE), w1.to(DEVICE),
                                        w3.to(DEVICE), w2.to(DEVICE), 4.0, 25.0)
    assert out.shape == (0, 40)
    gate = torch.zeros(0, 24, device=DEVICE)
    r, h = kernels.expert_major_situ_mlp_tail(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0,
                                              torch.ones(40, device=DEVICE), 1e-5, gate, gate, 4.0, 25.0)
    assert r.shape == (0, 40) and h.shape == (0, 24)


def test_selector_bounds_and_switches():
    """Taken past the slot kernel's bound (N·k > E/4) up to EXPERT_MAJOR_MAX_SLOTS, at inference, weights in z's
    dtype; on CPU tensors only when forced; on CUDA by default (timed on an H200), off where K3_NO_TRITON names it."""
    z = torch.zeros(8, 16)
    with force_expert_major(True):
        assert use_expert_major(z, 8, 64, torch.float32, needs_grad=False)  # 64 slots > 16
        assert not use_expert_major(z[:2], 8, 64, torch.float32, needs_grad=False)  # 16 slots: the slot kernel's
        assert not use_expert_major(z, 8, 64, torch.float32, needs_grad=True)
        assert not use_expert_major(z, 8, 64, torch.bfloat16, needs_grad=False)  # weights in another dtype
        assert not use_expert_major(z.double(), 8, 64, torch.float64, needs_grad=False)
        n = EXPERT_MAJOR_MAX_SLOTS // 8
        assert use_expert_major(torch.zeros(n, 16), 8, 64, torch.float32, needs_grad=False)
        assert not use_expert_major(torch.zeros(n + 1, 16), 8, 64, torch.float32, needs_grad=False)
    assert not use_expert_major(z, 8, 64, torch.float32, needs_grad=False)  # CPU, not forced
    if DEVICE == "cuda":
        zc = z.cuda()
        with envs.override(no_triton=["_moe_expert_major_triton"]):
            assert not use_expert_major(zc, 8, 64, torch.float32, needs_grad=False)
        with envs.override(triton_opt_in=[]):  # no longer in triton_dispatch.OPT_IN
            assert use_expert_major(zc, 8, 64, torch.float32, needs_grad=False)
            with force_expert_major(False):
                assert not use_expert_major(zc, 8, 64, torch.float32, needs_grad=False)


def test_dispatch_takes_the_op_and_compiles_as_one_call():
    """`selected_experts_situ_mlp` takes k3::moe_expert_major when chosen; under torch.compile (fullgraph) it is
    the one k3 op of the graph, with the eager op's answer."""
    from compile_recording import recording_backend

    z, idx, wt, w1, w3, w2 = (t.to(DEVICE) for t in case(6, 4, 16, 40, 24, seed=5))
    want = selected_experts_situ_mlp_reference(z.double(), idx, wt.double(), w1.double(), w3.double(), w2.double())
    ops = []
    with force_expert_major(True):
        eager = selected_experts_situ_mlp(z, idx, wt, w1, w3, w2)
        compiled = torch.compile(selected_experts_situ_mlp, backend=recording_backend(ops), fullgraph=True)
        got = compiled(z, idx, wt, w1, w3, w2)
    assert [op.removesuffix(".default") for op in ops if "k3." in op] == ["k3.moe_expert_major"], ops
    assert rel_err(eager, want) < 1e-5 and torch.equal(got, eager)


@pytest.mark.parametrize("gemv_on", [False, None])
def test_tiny_model_batched_decode_through_the_kernel_equals_the_full_forward(monkeypatch, gemv_on):
    """fp32 tiny model (16 experts, top-4), 3 sequences: a prefill of 5 tokens (60 slots) and 2 decode steps
    (12 slots, past the slot kernel's 4) with the kernel forced on, against one full forward on the grouped
    path; the kernel ran at every MoE layer of every step, with the routed norm and the shared GLU in its last
    launch where decode's GEMV does not take them as the shared down + routed up pair (`gemv_on`: off, or as
    chosen: on CUDA up to gemv.FUSED_WIN_ROWS rows; never on the CPU)."""
    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 7), device=DEVICE)
    calls = []
    inner, inner_tail = kernels.expert_major_situ_mlp, kernels.expert_major_situ_mlp_tail
    monkeypatch.setattr(kernels, "expert_major_situ_mlp", lambda z, *a: calls.append(z.shape[0]) or inner(z, *a))
    monkeypatch.setattr(kernels, "expert_major_situ_mlp_tail",
                        lambda z, *a: calls.append(("tail", z.shape[0])) or inner_tail(z, *a))
    with torch.no_grad():
        with force_expert_major(False):
            full = model(ids).logits
        cache = model.new_cache()
        with force_expert_major(True), force_gemv(gemv_on):
            steps = [model(ids[:, :5], cache=cache).logits]
            steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 7)]
    moe_layers = sum(1 for m in model.modules() if type(m).__name__ == "LatentMoE")

    def expected(rows):  # (tiny has a routed norm and shared experts: the tail, unless the pair takes them)
        pair = gemv_on is None and DEVICE == "cuda" and rows <= gemv.FUSED_WIN_ROWS
        return rows if pair else ("tail", rows)
    assert moe_layers > 0 and calls == [expected(15)] * moe_layers + [expected(3)] * (2 * moe_layers)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
