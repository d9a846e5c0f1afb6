"""The fused Block AttnRes mix (k3.ops._attn_res_triton) against the autograd-free reference `_AttnResMix`,
which tests/test_attn_res*.py check against plain autograd. On CUDA the kernels run natively; on a CPU with
triton installed they run under Triton's interpreter; without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3.model.attn_res import _AttnResMix, _AttnResMixFused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(fn, u, w, sources, grad):
    leaves = [t.detach().clone().requires_grad_() for t in [u, w, *sources]]
    extra = (None, 0.0) if fn is _AttnResMixFused else ()  # (the fused Function's norm weight and eps: no norm)
    out = fn.apply(leaves[0], leaves[1], 1e-5, *extra, *leaves[2:])
    out.backward(grad)
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("n,B,T,D,dtype", [
    (1, 2, 3, 64, torch.float32),
    (3, 2, 5, 96, torch.float32),  # D not a power of two
    (5, 1, 7, 200, torch.float32),
    (4, 3, 11, 128, torch.bfloat16),
    (2, 1, 1, 1536, torch.bfloat16),  # one row, as in batch-1 decode
])
def test_fused_mix_matches_reference(n, B, T, D, dtype):
    gen = torch.Generator().manual_seed(1000 * n + D)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    sources = [(r(B, T, D) * (i + 1)).to(DEVICE, dtype) for i in range(n)]  # unequal scales: a non-flat softmax
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (r(1, D) * 0.5).to(DEVICE)
    grad = r(B, T, D).to(DEVICE, dtype)
    want, got = run(_AttnResMix, u, w, sources, grad), run(_AttnResMixFused, u, w, sources, grad)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for name, a, b in zip(["out", "du", "dw"] + [f"d_source{i}" for i in range(n)], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-6)
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("n,R,D,dtype,nw_dtype", [
    (2, 13, 96, torch.float32, torch.float32),
    (4, 7, 200, torch.bfloat16, torch.float32),  # fp32 norm weight over bf16 sources (autocast's master weights)
    (3, 1, 1536, torch.bfloat16, torch.bfloat16),
])
def test_fused_mix_with_its_norm_matches_the_float64_reference(n, R, D, dtype, nw_dtype):
    """_AttnResMixFused with a norm weight (a block-start mix without an add, as `attn_res_mix(out_norm=)` takes
    it) against the float64 mix then RMSNorm by autograd: output, ∂L/∂u, ∂L/∂w, each source's and the norm
    weight's gradient."""
    from k3.ops.norm import rms_norm_reference

    gen = torch.Generator().manual_seed(40 * n + D)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    sources = [r(1, R, D) * (i + 1) for i in range(n)]
    u, w = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5, r(1, D) * 0.5
    nw, g = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5, r(1, R, D)
    ref = [t.detach().clone().requires_grad_() for t in [u, w, nw, *sources]]
    want_out = rms_norm_reference(_AttnResMix.apply(ref[0], ref[1], 1e-5, *ref[3:]), ref[2], 1e-6)
    want_out.backward(g)
    got_in = [t.detach().to(DEVICE, dt, copy=True).requires_grad_()
              for t, dt in zip([u, w, nw, *sources], [torch.float32, torch.float32, nw_dtype] + [dtype] * n)]
    out = _AttnResMixFused.apply(got_in[0], got_in[1], 1e-5, got_in[2], 1e-6, *got_in[3:])
    out.backward(g.to(DEVICE, dtype))
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # (bf16: the sources' gradients pass the norm's difference term)
    names = ["out", "du", "dw", "d_nw"] + [f"d_source{i}" for i in range(n)]
    for name, a, b in zip(names, [out] + [t.grad for t in got_in], [want_out] + [t.grad for t in ref], strict=True):
        assert a.dtype == {"du": torch.float32, "dw": torch.float32, "d_nw": nw_dtype}.get(name, dtype), name
        err = (a.double().cpu() - b).norm() / b.norm().clamp_min(1e-6)
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mix_backward_with_several_rows_per_program(monkeypatch, dtype):
    """Backward's programs stride over the rows, a row a step, each keeping one q partial: with 3 programs over
    2·37 rows every program walks several steps (the last one row short), and du, dw and the sources'
    gradients match."""
    from k3.ops import _attn_res_triton

    monkeypatch.setattr(_attn_res_triton, "_programs", lambda device, n_sources: 3)
    gen = torch.Generator().manual_seed(7)
    n, B, T, D = 3, 2, 37, 96
    sources = [(torch.randn(B, T, D, generator=gen) * (i + 1)).to(DEVICE, dtype) for i in range(n)]
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (torch.randn(1, D, generator=gen) * 0.5).to(DEVICE)
    grad = torch.randn(B, T, D, generator=gen).to(DEVICE, dtype)
    want, got = run(_AttnResMix, u, w, sources, grad), run(_AttnResMixFused, u, w, sources, grad)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for name, a, b in zip(["out", "du", "dw"] + [f"d_source{i}" for i in range(n)], got, want):
        err = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-6)
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("n,B,T,D,dtype,sum_read_on,nw_dtype", [
    (1, 2, 3, 64, torch.float32, False, torch.float32),  # the partial sum alone
    (3, 2, 5, 96, torch.float32, True, torch.float32),  # D not a power of two
    (4, 1, 19, 200, torch.float32, True, torch.float32),  # rows not a multiple of the tile
    (3, 3, 11, 128, torch.bfloat16, True, torch.float32),  # fp32 norm weight (autocast's master weights)
    (2, 1, 1, 1536, torch.bfloat16, False, torch.bfloat16),  # bf16 norm weight (bf16 parameters)
])
@pytest.mark.parametrize("normed", [False, True])
def test_add_then_mix_in_one_launch_matches_the_float64_reference(n, B, T, D, dtype, sum_read_on, nw_dtype, normed):
    """_AttnResAddMixFused (p + x added in the mix's forward launch) against the float64 reference: the add, then
    the SPEC mix over [*blocks, p + x] by plain autograd (normed: then an RMSNorm with a weight of nw_dtype, as the
    fold takes it into both launches). The output, the sum, and ∂L/∂u, ∂L/∂w, ∂L/∂p, ∂L/∂x, every block's
    gradient (and the norm weight's, in its dtype); sum_read_on: the sum also has a reader of its own (a gradient
    for it arrives, which the backward's kernel adds to the mix's part)."""
    from k3.model.attn_res import _AttnResAddMixFused
    from k3.ops.norm import rms_norm_reference

    gen = torch.Generator().manual_seed(300 + 10 * n + D)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    blocks = [r(B, T, D) * (i + 2) for i in range(n - 1)]
    p, x = r(B, T, D), r(B, T, D) * 0.5
    u, w = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5, r(1, D) * 0.5
    nw = torch.rand(D, generator=gen, dtype=torch.float64) + 0.5
    g_out, g_sum = r(B, T, D), r(B, T, D) if sum_read_on else None

    def leaves(tensors, dt, device):
        return [t.detach().to(device, dt, copy=True).requires_grad_() for t in tensors]

    ref = leaves([u, w, p, x, *blocks, nw], torch.float64, "cpu")
    total = ref[2] + ref[3]
    want_out = _AttnResMix.apply(ref[0], ref[1], 1e-5, *ref[4:-1], total)
    if normed:
        want_out = rms_norm_reference(want_out, ref[-1], 1e-6)
    torch.autograd.backward([want_out] + ([total] if sum_read_on else []),
                            [g_out] + ([g_sum] if sum_read_on else []))
    want = [want_out, total] + [t.grad for t in ref[:-1]] + ([ref[-1].grad] if normed else [])

    got_in = leaves([u, w], torch.float32, DEVICE) + leaves([p, x, *blocks], dtype, DEVICE) + leaves([nw], nw_dtype,
                                                                                                     DEVICE)
    out, got_total = _AttnResAddMixFused.apply(*got_in[:2], 1e-5, got_in[-1] if normed else None, 1e-6,
                                               *got_in[2:-1])
    assert out.dtype == got_total.dtype == dtype
    torch.autograd.backward([out] + ([got_total] if sum_read_on else []),
                            [g_out.to(DEVICE, dtype)] + ([g_sum.to(DEVICE, dtype)] if sum_read_on else []))
    got = [out, got_total] + [t.grad for t in got_in[:-1]] + ([got_in[-1].grad] if normed else [])
    assert (got_in[-1].grad is not None) == normed
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    names = ["out", "p + x", "du", "dw", "dp", "dx"] + [f"d_block{i}" for i in range(n - 1)] + ["d_nw"] * normed
    for name, a, b in zip(names, got, want, strict=True):
        want_dtype = {"du": torch.float32, "dw": torch.float32, "d_nw": nw_dtype}.get(name, dtype)
        assert a.shape == b.shape and a.dtype == want_dtype, name
        err = (a.double().cpu() - b).norm() / b.norm().clamp_min(1e-6)
        assert err < tol, f"{name}: relative error {err:.2e}"
    torch.testing.assert_close(got[4], got[5], rtol=0, atol=0)  # p's and x's: the sum's gradient, both


@pytest.mark.parametrize("change", [dict(preload=True), dict(preload=True, block_r=1), dict(preload=True, block_r=4),
                                    dict(block_r=1), dict(block_r=4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_forwards_launch_choices_give_the_defaults_results(monkeypatch, change, dtype):
    """LAUNCH (the training forward's sources loaded at once; rows a program) changes when loads issue and how rows
    tile, not the formulas: with the add and the norm, over 4 sources at 2·7 rows (not a multiple of any tile) and
    D 200, the output, the sum, the scores and the log-sum-exp equal the default launch's, bit for bit under the
    interpreter; on a GPU the tile decides the order of each row's sums (an H100 moved fp32 log-sum-exps and bf16
    outputs by rounding), so there to the dtype's rounding (torch's default tolerances)."""
    from k3.ops import _attn_res_triton

    gen = torch.Generator().manual_seed(77)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)  # noqa: E731
    sources, add = [r(2, 7, 200) * (i + 1) for i in range(4)], r(2, 7, 200)
    u, w = (torch.rand(200, generator=gen) + 0.5).to(DEVICE), (torch.randn(1, 200, generator=gen) * 0.5).to(DEVICE)
    norm = ((torch.rand(200, generator=gen) + 0.5).to(DEVICE, dtype), 1e-6)
    want = _attn_res_triton.mix_add_forward(u, w, 1e-5, tuple(sources), add, norm)
    monkeypatch.setattr(_attn_res_triton, "LAUNCH", {**_attn_res_triton.LAUNCH, **change})
    got = _attn_res_triton.mix_add_forward(u, w, 1e-5, tuple(sources), add, norm)
    exact = dict(rtol=0, atol=0) if DEVICE == "cpu" else {}
    for name, a, b in zip(["out", "sum", "scores", "lse"], got, want, strict=True):
        torch.testing.assert_close(a, b, **exact, msg=name)


@pytest.mark.parametrize("mask", [0b00, 0b01, 0b10, 0b11])
def test_backward_adds_into_the_buffers_it_is_given(mask):
    """mix_backward's `into`: where bit i of mask is set, source i's gradient is added to an addend (source 0:
    the buffer itself, in place, as a block's sum over its mixes; source 1: a separate addend, as a residual
    add's gradient), else it overwrites the buffer's (garbage) contents; at 5 rows over D 1000, odd both."""
    from k3.ops import _attn_res_triton

    gen = torch.Generator().manual_seed(11)
    n, R, D = 2, 5, 1000
    sources = tuple((torch.randn(R, D, generator=gen) * (i + 1)).to(DEVICE) for i in range(n))
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (torch.randn(1, D, generator=gen) * 0.5).to(DEVICE)
    grad = torch.randn(R, D, generator=gen).to(DEVICE)
    _, scores, lse = _attn_res_triton.mix_forward(u, w, 1e-5, sources)
    du0, dw0, fresh = _attn_res_triton.mix_backward(grad, u, w, 1e-5, sources, scores, lse)
    prior = [torch.randn(R, D, generator=gen).to(DEVICE) for _ in range(n)]
    bufs = [prior[0].clone(), torch.full((R, D), float("nan"), device=DEVICE)]
    into = [(bufs[0], bufs[0] if mask & 1 else None), (bufs[1], prior[1] if mask & 2 else None)]
    du, dw, got = _attn_res_triton.mix_backward(grad, u, w, 1e-5, sources, scores, lse, into=into)
    assert got[0] is bufs[0] and got[1] is bufs[1]
    for i in range(n):
        want = fresh[i] + prior[i] if mask >> i & 1 else fresh[i]
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(du, du0) and torch.equal(dw, dw0)


def test_dispatch_switches():
    """use_triton: off on CPU tensors; on CUDA, K3_NO_TRITON turns all or listed kernels off, and the opt-in
    kernels run only when named in K3_TRITON (or K3_TRITON=all). The switches as k3.envs parses them."""
    from k3 import envs
    from k3.ops import triton_dispatch as td

    assert not td.use_triton(torch.zeros(2), "_attn_res_triton")
    if not torch.cuda.is_available():
        return
    x = torch.zeros(2, device="cuda")
    for env, on, want in [("", "", {"_attn_res_triton": True, "_conv_triton": True, "_mla_decode_triton": False}),
                          ("1", "all", {"_attn_res_triton": False, "_conv_triton": False}),
                          ("_norm_triton,_conv_triton", "_mla_decode_triton",
                           {"_attn_res_triton": True, "_norm_triton": False, "_conv_triton": False,
                            "_mla_decode_triton": True}),
                          ("", "all", {"_conv_triton": True, "_mla_decode_triton": True})]:
        parsed = envs.parse({"K3_NO_TRITON": env, "K3_TRITON": on})
        with envs.override(no_triton=parsed.no_triton, triton_opt_in=parsed.triton_opt_in):
            assert {name: td.use_triton(x, name) for name in want} == want, (env, on)


def test_backward_is_bitwise_reproducible():
    """du and dw are sums over every row (per-program partials, then their sum in a fixed order, no atomics):
    two backwards of the same inputs give the same bits."""
    from k3.ops import _attn_res_triton

    gen = torch.Generator().manual_seed(5)
    sources = tuple((torch.randn(2, 13, 96, generator=gen) * (i + 1)).to(DEVICE, torch.bfloat16) for i in range(3))
    u, w = (torch.rand(96, generator=gen) + 0.5).to(DEVICE), (torch.randn(1, 96, generator=gen) * 0.5).to(DEVICE)
    grad = torch.randn(2, 13, 96, generator=gen).to(DEVICE, torch.bfloat16)
    _, scores, lse = _attn_res_triton.mix_forward(u, w, 1e-5, sources)
    first, second = (_attn_res_triton.mix_backward(grad, u, w, 1e-5, sources, scores, lse) for _ in range(2))
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("iters", [None, 1])
def test_backward_compiles_for_sm90_with_its_next_row_in_flight(iters):
    """Compiled for the H200 (no GPU: tests/sm90_compile.py) as the launch at `small`'s shapes does (3 sources,
    D 1536, 2 stages), the backward's row loop is pipelined: the next row's loads are asynchronous copies
    (cp.async) issued before this row's math; and it compiles where Triton specialises iters == 1 (a row a
    program). Under the interpreter the loop runs a row at a time (STAGES 1): only this compile sees the
    pipelined form."""
    from sm90_compile import ptx_for_sm90

    from k3.ops import _attn_res_triton

    n = 3
    sig = {"srcs": ["*bf16"] * n, "grads": ["*bf16"] * n, "addends": ["*bf16"] * n, "g_ptr": "*bf16",
           "uw_ptr": "*fp32", "scores_ptr": "*fp32", "lse_ptr": "*fp32", "q_ptr": "*fp32", "R": "i32", "D": "i32",
           "eps": "fp32", "accumulate": "i32", **({"iters": "i32"} if iters is None else {})}
    ptx = ptx_for_sm90("k3.ops._attn_res_triton", "_mix_bwd_kernel", sig, num_warps=_attn_res_triton.NUM_WARPS["bwd"],
                       N=n, BLOCK_D=2048, STAGES=2, **({} if iters is None else {"iters": 1}))
    assert ".entry _mix_bwd_kernel" in ptx
    if iters is None:
        assert "cp.async" in ptx
