"""Decode GEMV (k3.ops.gemv) session 13: the RMSNorm folded into the kernel (g ⊙ x in the K loop, the row's rstd in
the epilogue) against the plain norm + matmul, the MoE's routed norm + up projection + shared add as that one
kernel, and the shape rule (`kernel_wins`) that keeps cuBLAS where it was faster on an H200. Without CUDA the
kernel runs under the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from k3.config import K3Config  # noqa: E402
from k3.model.norm import RMSNorm  # noqa: E402
from k3.ops import _gemv_triton, gemv, triton_dispatch  # noqa: E402
from k3.ops.gemv import force_gemv, kernel_wins, linear, use_gemv  # noqa: E402
from k3.ops.situ import situ_glu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rtol, atol as a fraction of the largest output): fp32 sums of K products; bf16 one ulp at the largest output (the
# interpreter rounds fp32 -> bf16 toward zero; the plain path rounds the normalised x and the product as well)
TOL = {torch.float32: (1e-5, 2 ** -20), torch.bfloat16: (2 ** -7, 2 ** -7)}


def check(y, want, dtype, ulps=1):
    rtol, atol = TOL[dtype]
    atol = ulps * atol * max(1.0, want.abs().max().item())
    torch.testing.assert_close(y.double(), want.double(), rtol=rtol, atol=atol)


def fp64_norm_linear(x, g, eps, w, res=None):
    """RMSNorm then the matmul (+ residual), in float64 from the stored values."""
    xd = x.double()
    y = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()) @ w.double().t()
    return y if res is None else y + res.double()


# (M, N, K): FMA tiles with and without split K (the reduce kernel then scales the rows), K not a multiple of the
# norm's 1024-wide tiles (two passes), and tl.dot tiles at 8 and 13 rows (forced: past the shape rule's rows)
SHAPES = [(1, 37, 129), (1, 40, 2500), (3, 300, 513), (8, 45, 96), (13, 30, 1100), (48, 70, 1100)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_in_the_kernel_equals_norm_then_matmul(M, N, K, dtype, with_residual):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(DEVICE)  # noqa: E731
    x, w, nw = r(M, K, scale=3.0), r(N, K), r(K).abs() + 0.5  # (x not unit-scale: the rstd must matter)
    res = r(M, N) if with_residual else None
    with force_gemv(True):
        assert use_gemv(x, w, None, res, nw)
        y = linear(x, w, None, res, nw, 1e-5)
    assert y.dtype == dtype and y.shape == (M, N)
    check(y, fp64_norm_linear(x, nw, 1e-5, w, res), dtype)
    with force_gemv(False):  # the plain path (rms_norm, F.linear, the add) agrees with the same float64 answer
        plain = linear(x, w, None, res, nw, 1e-5)
    check(plain, fp64_norm_linear(x, nw, 1e-5, w, res), dtype)


def test_the_norm_shapes_reach_both_epilogues():
    """The shapes above put the rstd in the main kernel's epilogue (K whole) and in the split reduction's."""
    splits = {_gemv_triton.plan(M, N, K, torch.bfloat16, 132)["split"] > 1 for M, N, K in SHAPES}
    assert splits == {False, True}


def test_the_norm_pass_keeps_its_tile_of_x_within_its_budget():
    """The row norm's pass over x (`_row_rstd`) takes at most norm_tile_elems elements of the tile's rows (64 rows:
    256 columns, not 1,024) and covers K in whole passes."""
    budget = _gemv_triton.LAUNCH["norm_tile_elems"]
    for block_m, K in ((1, 5000), (16, 1536), (32, 700), (64, 1100), (64, 8)):
        n = _gemv_triton.norm_pass(K, block_m)
        assert n["NORM_BLOCK"] * block_m <= max(budget, 16 * block_m) and n["NORM_K"] % n["NORM_BLOCK"] == 0
        assert n["NORM_K"] - n["NORM_BLOCK"] < K <= n["NORM_K"]
    assert _gemv_triton.norm_pass(1536, 64)["NORM_BLOCK"] == 256
    assert _gemv_triton.norm_pass(1536, 16)["NORM_BLOCK"] == 1024


def test_a_norm_weight_that_does_not_fit_is_refused():
    x, w = torch.zeros(1, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    with force_gemv(True):
        assert use_gemv(x, w, None, None, torch.ones(64, device=DEVICE))
        assert not use_gemv(x, w, None, None, torch.ones(63, device=DEVICE))  # not x's width
        assert not use_gemv(x, w, None, None, torch.ones(64, dtype=torch.float64, device=DEVICE))
        assert not use_gemv(x, w, None, None, torch.ones(64, device=DEVICE, requires_grad=True))  # a gradient


def test_shape_rule_takes_the_kernel_only_where_it_won(monkeypatch):
    """small's linears (µs ours / cuBLAS): at 1 row the narrow ones won on the H200 (session 13: q_b 2.9/3.5, the
    routed up 3.2/6.0, the shared down 3.2/5.1, o_proj 5.5/6.5) and, with 4 rows of W a program, the large input
    projections on the H100 (session 38: KDA's 9.2/10.0, the MoE's 5.6/6.2): they take the kernel; lm_head keeps
    cuBLAS. At 4 rows the large ones keep cuBLAS (the MoE's 10.2/6.2); at 8 rows every one of these lost or tied."""
    won = [(2304, 384), (1536, 768), (1536, 1024), (1536, 1536)]
    large = [(6288, 1536), (2816, 1536), (2240, 1536), (1536, 6144)]
    assert all(kernel_wins(1, n, k) for n, k in won + large)
    assert not kernel_wins(1, 32768, 1536)  # lm_head
    assert all(kernel_wins(4, n, k) for n, k in won) and not any(kernel_wins(4, n, k) for n, k in large)
    assert not any(kernel_wins(8, n, k) for n, k in won)
    # the selector applies it once the kernel is chosen for x (as on CUDA: use_triton_op's device test passed)
    monkeypatch.setattr(gemv, "use_triton_op", lambda x, name: True)
    with torch.no_grad():
        assert use_gemv(torch.zeros(1, 384), torch.zeros(2304, 384))
        assert use_gemv(torch.zeros(4, 1, 384), torch.zeros(2304, 384))  # 4 rows
        assert not use_gemv(torch.zeros(5, 384), torch.zeros(2304, 384))  # 5 rows: cuBLAS
        assert not use_gemv(torch.zeros(1, 1536), torch.zeros(32768, 1536))  # lm_head: cuBLAS
        with force_gemv(True):  # forced: any shape the kernel can run
            assert use_gemv(torch.zeros(8, 1536), torch.zeros(32768, 1536))
    monkeypatch.setattr(gemv, "use_triton_op", lambda x, name: False)  # not chosen (CPU, switched off): never
    assert not use_gemv(torch.zeros(1, 384), torch.zeros(2304, 384))


def test_a_prologue_takes_the_kernel_up_to_the_fused_rows(monkeypatch):
    """With a norm, a SiTU-GLU or an output gate before it (kernels of their own on cuBLAS's path) the kernel is
    taken up to FUSED_WIN_ROWS rows, a plain linear still up to WIN_ROWS; the pair (two GEMMs and their add in one
    launch) counts as fused; the weight bound holds either way."""
    monkeypatch.setattr(gemv, "use_triton_op", lambda x, name: True)
    monkeypatch.setattr(gemv, "FUSED_WIN_ROWS", 64)
    x, w, big = torch.zeros(64, 1536), torch.zeros(1536, 1536), torch.zeros(6144, 1536)
    with torch.no_grad():
        assert not use_gemv(x, w)  # no prologue: cuBLAS past WIN_ROWS
        assert not use_gemv(x, w, residual=torch.zeros(64, 1536))  # (cuBLAS sums a residual in its GEMM)
        assert use_gemv(x, w, out_gate=torch.zeros(64, 1536))
        assert use_gemv(x, w, glu_up=torch.zeros(64, 1536))
        assert use_gemv(x, w, norm_weight=torch.ones(1536))
        assert not use_gemv(torch.zeros(65, 1536), w, norm_weight=torch.ones(1536))  # past the fused rows
        assert not use_gemv(x, big, norm_weight=torch.ones(1536))  # past the weight bound
        r, up = torch.zeros(64, 768), torch.zeros(64, 1024)
        assert gemv.use_gemv_pair(up, torch.zeros(1536, 1024), r, torch.zeros(1536, 768))  # no prologue: still fused
    monkeypatch.undo()  # the default (16 rows, where it won on the step): a prologue's linear at 16 rows, not 17
    monkeypatch.setattr(gemv, "use_triton_op", lambda x, name: True)
    with torch.no_grad():
        assert use_gemv(x[:16], w, out_gate=torch.zeros(16, 1536))
        assert not use_gemv(x[:17], w, out_gate=torch.zeros(17, 1536))
        assert not use_gemv(x[:16], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_takes_norm_up_and_shared_add_in_one_kernel(dtype, monkeypatch):
    """A tiny LatentMoE at 2 decode rows with the GEMV forced on: the routed norm is not run as its own op, the up
    projection's launch carries its weight and norm, the shared experts' down projection with their SiTU-GLU
    (gate and up) is the same launch's first segment, and the layer's output equals the unfused layer's (the
    norm, the GLU, the F.linears, the add)."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)  # fewer, larger programs: the interpreter's pace
    from test_gemv_pair import _moe

    cfg, moe = _moe(dtype)
    x = torch.randn(2, 1, cfg.hidden_size, device=DEVICE, dtype=dtype)
    launches, norm_calls = [], []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a: launches.append(a) or launch(*a))
    pairs = []
    launch_pair = gemv._launch_pair
    monkeypatch.setattr(gemv, "_launch_pair", lambda *a: pairs.append(a) or launch_pair(*a))
    norm = gemv.rms_norm
    monkeypatch.setattr(gemv, "rms_norm", lambda *a: norm_calls.append(a[1]) or norm(*a))
    with torch.no_grad():
        with force_gemv(True):
            fused = moe(x)
        assert not norm_calls
        shared = moe.shared_experts
        # the shared down (its SiTU-GLU in the prologue) and the routed up (its norm) are one two-segment launch
        assert not [a for a in launches if a[1] is moe.routed_expert_up_proj.weight or a[1] is shared.down_proj.weight]
        assert len(pairs) == 1
        _, weight_a, glu_up, beta_gate, beta_up, _, weight_b, norm_weight, eps = pairs[0]
        assert weight_a is shared.down_proj.weight and glu_up is not None and (beta_gate, beta_up) == shared.betas
        assert weight_b is moe.routed_expert_up_proj.weight and norm_weight is moe.routed_expert_norm.weight
        assert eps == moe.routed_expert_norm.eps
        # the plain path runs the norm (on CUDA the expert-major kernels' last launch would take it: k3.ops.moe_decode)
        monkeypatch.setitem(triton_dispatch.triton_module("_moe_expert_major_triton").LAUNCH, "tail", False)
        with force_gemv(False):
            plain = moe(x)
        assert norm_calls == [moe.routed_expert_norm.weight]
    check(fused, plain, dtype, ulps=4)  # bf16: the plain layer rounds the norm, the product and the sum, each <= 1 ulp


def test_plain_path_keeps_gradients_through_the_norm():
    """Training's path (a gradient wanted): the norm and the linear as autograd ops, gradients reach the norm's
    weight and x, equal to RMSNorm + nn.Linear by hand."""
    torch.manual_seed(1)
    lin = gemv.DecodeLinear(48, 20, bias=False)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 48, requires_grad=True)
    lin(x, norm=norm).square().sum().backward()
    got = (x.grad.clone(), norm.weight.grad.clone(), lin.weight.grad.clone())
    x.grad = norm.weight.grad = lin.weight.grad = None
    torch.nn.functional.linear(norm(x), lin.weight).square().sum().backward()
    for a, b in zip(got, (x.grad, norm.weight.grad, lin.weight.grad)):
        torch.testing.assert_close(a, b)


def test_norm_kernels_compile_for_the_h200():
    """The routed up projection's launch at 1 bf16 row ([1536, 768]: K whole) with the norm and residual, compiled
    for sm_90 by ptxas (no GPU needed): its epilogue takes the row's rstd (a sqrt); the same tiles with K split
    (as [1024, 4096]'s) leave the rstd to the split reduction, which takes it."""
    from sm90_compile import ptx_for_sm90

    p = _gemv_triton.plan(1, 1536, 768, torch.bfloat16, 132)
    assert p["split"] == 1 and not p["use_dot"] and _gemv_triton.plan(1, 1024, 4096, torch.bfloat16, 132)["split"] > 1
    norm = dict(HAS_NORM=True, NORM_K=1024, NORM_BLOCK=1024)
    no_glu = dict(HAS_GLU=False, GLU_EXACT=False)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "tickets_ptr": "*i32", "norm_w_ptr": "*bf16", "eps": "fp32", "up_ptr": "*bf16",
           "beta_gate": "fp32", "beta_up": "fp32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_um": "i32"}
    for split in (True, False):  # (split: the block's last split takes the rstd after its ticket)
        ptx = ptx_for_sm90("k3.ops._gemv_triton", "_gemv_kernel", sig, num_warps=p["warps"], HAS_BIAS=False,
                           HAS_RES=True, SPLIT=split, USE_DOT=False, DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                           BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"],
                           NUM_STAGES=p["stages"], **norm, **no_glu)
        assert "sqrt" in ptx and "fma.rn.f32" in ptx and ("atom.global" in ptx) == split
    p = _gemv_triton.plan(1, 1536, 1024, torch.bfloat16, 132)  # the shared experts' down with its SiTU-GLU
    ptx = ptx_for_sm90("k3.ops._gemv_triton", "_gemv_kernel", sig, num_warps=p["warps"], HAS_BIAS=False,
                       HAS_RES=False, SPLIT=p["split"] > 1, USE_DOT=False, DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                       BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"], NUM_STAGES=p["stages"],
                       HAS_NORM=False, NORM_K=1024, NORM_BLOCK=1024, HAS_GLU=True, GLU_EXACT=False)
    assert "ex2.approx" in ptx  # the GLU's exps


def fp64_glu_linear(gate, up, w, betas, res=None):
    """SiTU-GLU(gate, up) rounded to the gate's dtype (as k3.ops.situ.situ_glu's h), then the matmul, in float64."""
    h = situ_glu(gate.double(), up.double(), *betas).to(gate.dtype).double()
    y = h @ w.double().t()
    return y if res is None else y + res.double()


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_in_the_kernel_equals_situ_glu_then_matmul(M, N, K, dtype):
    """The SiTU-GLU prologue: gate and up read as column slices of one fused projection's output (row stride past
    K, as the MoE's shared experts' are), values out to the bounds' saturation (|gate| to 20, |up| to 60)."""
    g = torch.Generator().manual_seed(M * 11 + N + K)
    fused = (torch.randn(M, 2 * K + 3, generator=g) * 8.0).to(dtype).to(DEVICE)
    gate, up = fused[:, :K], fused[:, K + 3:]
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    betas = (4.0, 25.0)
    with force_gemv(True):
        assert use_gemv(gate, w, None, res, None, up)
        y = linear(gate, w, None, res, glu_up=up, glu_betas=betas)
    check(y, fp64_glu_linear(gate, up, w, betas, res), dtype)
    with force_gemv(False):
        plain = linear(gate, w, None, res, glu_up=up, glu_betas=betas)
    check(plain, fp64_glu_linear(gate, up, w, betas, res), dtype, ulps=2)  # (the product rounded, then the sum)


def test_glu_inputs_that_do_not_fit_are_refused():
    x, w = torch.zeros(2, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    with force_gemv(True):
        assert use_gemv(x, w, None, None, None, torch.zeros(2, 64, device=DEVICE))
        assert not use_gemv(x, w, None, None, None, torch.zeros(2, 63, device=DEVICE))  # not the gate's shape
        assert not use_gemv(x, w, None, None, None, torch.zeros(64, 2, device=DEVICE).t())  # columns strided
        assert not use_gemv(x, w, None, None, torch.ones(64, device=DEVICE), torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="cannot be combined"):
        gemv.linear_reference(x, w, None, None, torch.ones(64, device=DEVICE), 1e-5, torch.zeros(2, 64, device=DEVICE))


def fp64_gated_linear(x, gate, w, res=None):
    """x ⊙ σ(gate) rounded to x's dtype (what the kernel reads), then the matmul (+ residual), in float64."""
    h = (x.double() * torch.sigmoid(gate.double())).to(x.dtype).double()
    y = h @ w.double().t()
    return y if res is None else y + res.double()


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_gate_in_the_kernel_equals_sigmoid_gate_then_matmul(M, N, K, dtype):
    """MLA's o ⊙ σ(gate) before o_proj as the kernel's prologue: the gate a column slice of a wider projection's
    output (row stride past K, as MLA's fused in_proj gives it), gates out to σ's saturation (|gate| to ~40)."""
    g = torch.Generator().manual_seed(M * 7 + N + 3 * K)
    fused = (torch.randn(M, K + 5, generator=g) * 10.0).to(dtype).to(DEVICE)
    gate = fused[:, 5:]
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    with force_gemv(True):
        assert use_gemv(x, w, None, res, out_gate=gate)
        y = linear(x, w, None, res, out_gate=gate)
    check(y, fp64_gated_linear(x, gate, w, res), dtype)
    with force_gemv(False):
        plain = linear(x, w, None, res, out_gate=gate)
    check(plain, fp64_gated_linear(x, gate, w, res), dtype, ulps=2)  # (σ rounded, the product, then the sum)


def test_output_gates_that_do_not_fit_are_refused():
    x, w = torch.zeros(2, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    with force_gemv(True):
        assert use_gemv(x, w, out_gate=torch.zeros(2, 64, device=DEVICE))
        assert not use_gemv(x, w, out_gate=torch.zeros(2, 63, device=DEVICE))  # not x's shape
        assert not use_gemv(x, w, out_gate=torch.zeros(64, 2, device=DEVICE).t())  # columns strided
        assert not use_gemv(x, w, norm_weight=torch.ones(64, device=DEVICE), out_gate=torch.zeros(2, 64, device=DEVICE))
        assert not use_gemv(x, w, glu_up=torch.zeros(2, 64, device=DEVICE), out_gate=torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="cannot be combined"):
        gemv.linear_reference(x, w, glu_up=torch.zeros(2, 64, device=DEVICE), out_gate=torch.zeros(2, 64, device=DEVICE))


def test_output_gate_kernel_compiles_for_the_h200():
    """o_proj's launch at 1 bf16 row ([1536, 1536]: K split) with the gate in its prologue, compiled for sm_90 by
    ptxas: the gate's sigmoid is in the K loop (an exp)."""
    from sm90_compile import ptx_for_sm90

    p = _gemv_triton.plan(1, 1536, 1536, torch.bfloat16, 132)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "tickets_ptr": "*i32", "norm_w_ptr": "*bf16", "eps": "fp32", "up_ptr": "*bf16",
           "beta_gate": "fp32", "beta_up": "fp32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_um": "i32"}
    ptx = ptx_for_sm90("k3.ops._gemv_triton", "_gemv_kernel", sig, num_warps=p["warps"], HAS_BIAS=False,
                       HAS_RES=False, SPLIT=p["split"] > 1, USE_DOT=False, DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                       BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"], NUM_STAGES=p["stages"],
                       HAS_NORM=False, NORM_K=1024, NORM_BLOCK=1024, HAS_GLU=False, GLU_EXACT=False, OUT_GATE=True)
    assert "ex2.approx" in ptx


def test_model_decode_folds_norms_and_glu_into_the_kernel(monkeypatch):
    """fp32 tiny model, StaticCache decode with the GEMV forced on: each MLA layer's q_b launch carries its q_a norm
    and its o_proj launch the output gate, each MoE layer's shared down (with their GLU) and routed up (with its
    routed norm) are one two-segment launch; the logits equal the same decode with the kernel off and the full
    forward."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)  # fewer, larger programs: the interpreter's pace
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_tile_elems", 1 << 16)
    from k3.model.decoder import K3ForCausalLM
    from k3.ops.fused_linear import fuse_projections

    cfg = K3Config.preset("tiny")
    torch.manual_seed(4)
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    fuse_projections(model)
    launches = []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a: launches.append(a) or launch(*a))
    pairs = []
    launch_pair = gemv._launch_pair
    monkeypatch.setattr(gemv, "_launch_pair", lambda *a: pairs.append(a) or launch_pair(*a))
    B, T = 2, 5
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device=DEVICE)
    steps = {}
    with torch.no_grad():
        # (the full forward and the prefill off the kernel: on CUDA it takes up to FUSED_WIN_ROWS rows by default,
        # and only the decode step's launches are counted)
        with force_gemv(False):
            full = model(ids).logits[:, -1]
        for on in (True, False):
            cache = model.new_cache(B, T + 1)
            with force_gemv(False):
                model(ids[:, :T], cache=cache)
            with force_gemv(on):
                steps[on] = model(ids[:, T:], cache=cache).logits[:, -1]
    by_weight = {id(a[1]): a for a in launches}
    mla = [layer.self_attn for layer in model.model.layers if layer.is_mla]
    moe = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    assert mla and moe
    for m in mla:
        # q_b's launch (the one carrying the q_a norm): q_b's weight, or, where the StaticCache decode kernel
        # takes the layer, the kept q_b·W_UK product fuse_projections made (compared by value)
        (q_launch,) = [a for a in launches if a[4] is m.q_a_layernorm.weight]
        assert q_launch[1] is m.q_b_proj.weight or (
            m.absorbed_q.weight is not None and torch.equal(q_launch[1], m.absorbed_q.current()))
        assert by_weight[id(m.o_proj.weight)][9] is not None  # o ⊙ σ(gate) in o_proj's prologue
    pair_of = {id(a[1]): a for a in pairs}  # (the shared down and the routed up: one launch, tests/test_gemv_pair)
    for m in moe:
        a, weight_a, glu_up, _, _, b, weight_b, norm_weight, _ = pair_of[id(m.shared_experts.down_proj.weight)]
        assert glu_up is not None and weight_b is m.routed_expert_up_proj.weight
        assert norm_weight is m.routed_expert_norm.weight
        assert id(m.routed_expert_up_proj.weight) not in by_weight
    torch.testing.assert_close(steps[True], steps[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[True], full, rtol=1e-4, atol=1e-4)
