"""The MoE router: the reference selection's tie rule, the one-launch Triton kernel (k3.ops._router_triton)
against the reference (native on CUDA, under Triton's interpreter on a CPU with triton installed), and the
bf16 GEMM with fp32 output and its backward against autograd on fp32 copies."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import

from k3.ops.router import (_LowPrecisionRouterLogits, route, route_tokens, router_scores_reference, top_k_ids,
                           use_router_kernel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernels():
    pytest.importorskip("triton")
    from k3.ops import _router_triton
    return _router_triton


def test_reference_breaks_ties_to_the_lower_expert_id():
    """Equal keys (score + bias) go to the lower id, in every position of the top-k, whatever torch.topk does
    with them; the weights are the unbiased scores of the picked ids."""
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7, 0.2],
                           [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]])
    idx, w = route(scores, torch.zeros(6), 2, renormalize=False)
    assert idx.tolist() == [[1, 2], [0, 1]]
    idx, _ = route(scores, torch.zeros(6), 4, renormalize=False)
    assert idx.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]
    # a tie made by the bias: keys 0.5+0.25 = 0.75 = 0.5+0.25 for ids 0 and 5; weights stay unbiased
    bias = torch.tensor([0.25, 0.0, 0.0, 0.0, 0.0, 0.25])
    scores = torch.tensor([[0.5, 0.625, 0.125, 0.0, 0.0, 0.5]])
    idx, w = route(scores, bias, 2, renormalize=False, scale=2.0)
    assert idx.tolist() == [[0, 5]] and w.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("seed, E, k", [(0, 64, 8), (1, 7, 7), (2, 160, 16), (3, 2, 1)])
def test_top_k_ids_pick_what_a_stable_descending_sort_picks(seed, E, k):
    """The fp32 selection (one topk over int64 keys) against the stable sort it stands for, on rows made of ties:
    few distinct values, both zeros, negatives, ±inf and NaN of either sign (above every number, as torch.sort
    puts it), and values one ulp apart. On CUDA where there is one (its topk differs from the CPU's), else the CPU."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0.0, -0.0, 0.5, -0.5, 1e-38, -1e-38, 3.0, float("inf"), float("-inf"), float("nan"),
                         -float("nan"), 1.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), -7.0, 1e-45])
    s = pool[torch.randint(len(pool), (300, E), generator=g)]
    s[:100] = torch.randn(100, E, generator=g).round(decimals=1)  # plain scores, with ties
    s = s.to(DEVICE)
    want = torch.sort(s.cpu().double(), dim=-1, descending=True, stable=True).indices[:, :k]  # (−0.0 == 0.0 there)
    got = top_k_ids(s, k)
    assert got.dtype == torch.int64 and got.shape == (300, k)
    assert torch.equal(got.cpu(), want)
    # other dtypes: the device's own stable sort (CUDA's orders some of these ties unlike the CPU's: the fp32
    # keys follow the CPU's)
    by_sort = torch.sort(s.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(top_k_ids(s.double(), k), by_sort)


def exact_case(N, E, D, k, seed, ties=True):
    """x and W of small multiples of 1/8 and 1/16 (every partial sum exact in fp32, in any order), so equal logits
    stay exactly equal in any kernel: with `ties`, W repeats rows (duplicate experts) and the bias pairs
    others up."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (N, D), generator=g).float() / 8
    W = torch.randint(-3, 4, (E, D), generator=g).float() / 16
    bias = torch.randint(-2, 3, (E,), generator=g).float() / 64
    if ties:
        W[1::3] = W[0::3][: W[1::3].shape[0]]  # experts 3j+1 copy 3j: equal scores
        bias[1::3] = bias[0::3][: bias[1::3].shape[0]]  # and equal keys
        x[N // 2] = 0  # one row with every score sigmoid(0): all E keys tie but for the bias
    return x, W, bias


@pytest.mark.parametrize("N,E,D,k", [
    (1, 64, 1536, 8),  # small's router at batch-1 decode
    (5, 16, 128, 4),  # tiny's
    (3, 13, 100, 3),  # E and D not multiples of the blocks
    (4, 24, 700, 1),  # top-1
    (2, 12, 64, 12),  # top-k = every expert
    (7, 40, 33, 16),
    (2, 200, 96, 16),  # past 128 experts: k rounds of the largest free key, not places
    (3, 128, 64, 8),  # the most experts selected by places
])
@pytest.mark.parametrize("renormalize,scale", [(True, 1.0), (False, 2.5)])
def test_kernel_selects_exactly_as_the_reference(N, E, D, k, renormalize, scale):
    """Same ids in the same order (ties in the keys included: duplicate experts, a row of all-equal scores),
    weights at fp32 tolerance, fp32 scores; the ticket workspace comes back zero."""
    kt = kernels()
    x, W, bias = exact_case(N, E, D, k, seed=N * 1000 + E)
    ref_scores = router_scores_reference(x.double(), W.double())
    ref_idx, ref_w = route(ref_scores, bias.double(), k, renormalize, scale)
    assert (ref_scores.unsqueeze(-1) == ref_scores.unsqueeze(-2)).sum() > N * E  # ties exist
    tickets = torch.zeros(N + 3, dtype=torch.int32, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):  # every value is exact in bf16 too
        idx, w, scores = kt.route_tokens(x.to(DEVICE, dtype), W.to(DEVICE, dtype), bias.to(DEVICE), k,
                                         renormalize, scale, tickets)
        assert idx.dtype == torch.int64 and w.dtype == scores.dtype == torch.float32
        assert torch.equal(idx.cpu(), ref_idx), dtype
        torch.testing.assert_close(w.cpu().double(), ref_w, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(scores.cpu().double(), ref_scores, rtol=2e-6, atol=1e-7)
        assert not tickets.any()


def test_kernel_reads_x_and_the_weight_as_stored():
    """bf16 x with an fp32 weight (an fp32 master under bf16 activations), random values: the scores of the
    kernel's fp32 products of the stored values equal the float64 reference of the same values."""
    kt = kernels()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, generator=g).bfloat16()
    W = torch.randn(20, 300, generator=g) * 0.05
    bias = torch.randn(20, generator=g) * 0.01
    idx, w, scores = kt.route_tokens(x.to(DEVICE), W.to(DEVICE), bias.to(DEVICE), 5, True, 1.0)
    want = router_scores_reference(x.double(), W.double())
    torch.testing.assert_close(scores.cpu().double(), want, rtol=1e-5, atol=1e-6)
    want_idx, want_w = route(want, bias.double(), 5)
    assert torch.equal(idx.cpu(), want_idx)  # random scores: no near-ties at this tolerance
    torch.testing.assert_close(w.cpu().double(), want_w, rtol=1e-5, atol=1e-6)


def test_kernel_compiles_as_one_custom_op():
    """Under torch.compile (fullgraph: no break around it) the kernel is the one op k3::route_tokens_decode:
    the same ids, weights and scores as the eager kernel and the reference, the caller's workspace left zero."""
    kt = kernels()
    x, W, bias = (t.to(DEVICE) for t in exact_case(3, 24, 200, 4, seed=11))
    tickets = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    from compile_recording import recording_backend

    ops = []
    compiled = torch.compile(kt.route_tokens, backend=recording_backend(ops), fullgraph=True)
    idx, w, scores = compiled(x, W, bias, 4, True, 1.5, tickets)
    eager_idx, eager_w, eager_scores = kt.route_tokens(x, W, bias, 4, True, 1.5)
    ref_scores = router_scores_reference(x.cpu().double(), W.cpu().double())  # the reference on the CPU
    ref_idx, ref_w = route(ref_scores, bias.cpu().double(), 4, True, 1.5)
    assert [op for op in ops if "k3." in op] == ["k3.route_tokens_decode"], ops
    assert torch.equal(idx, eager_idx) and torch.equal(w, eager_w) and torch.equal(scores, eager_scores)
    assert torch.equal(idx.cpu(), ref_idx)
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=2e-6, atol=1e-7)
    assert not tickets.any()


@pytest.mark.parametrize("E", [64, 200])
def test_kernel_picks_k_distinct_experts_past_a_nan_score(E):
    """A NaN in x makes every score of its row NaN, and one NaN in the bias one expert's key: the kernel still
    writes k distinct valid ids for every row (the places path counts a NaN key as -inf), and the rows without
    NaN select exactly as the reference."""
    kt = kernels()
    x, W, bias = exact_case(4, E, 64, 8, seed=E, ties=False)
    x[1, 3] = float("nan")
    bias[5] = float("nan")
    idx, w, _ = kt.route_tokens(x.to(DEVICE), W.to(DEVICE), bias.to(DEVICE), 8, True, 1.0)
    idx = idx.cpu()
    assert ((idx >= 0) & (idx < E)).all()
    if E <= 128:  # the places path; the rounds path picks valid ids but may repeat one for a NaN row
        assert all(len(set(r)) == 8 for r in idx.tolist())
    clean = [0, 2, 3]
    ref_idx, ref_w = route(router_scores_reference(x[clean].double(), W.double()),
                           torch.where(bias.isnan(), float("-inf"), bias).double(), 8)
    assert torch.equal(idx[clean], ref_idx)
    torch.testing.assert_close(w.cpu()[clean].double(), ref_w, rtol=2e-6, atol=1e-7)


def test_kernel_refuses_a_bad_top_k_and_workspace():
    kt = kernels()
    x, W, bias = (t.to(DEVICE) for t in exact_case(2, 8, 16, 2, seed=1, ties=False))
    with pytest.raises(ValueError, match="top_k"):
        kt.route_tokens(x, W, bias, 9, True, 1.0)
    with pytest.raises(ValueError, match="tickets"):
        kt.route_tokens(x, W, bias, 2, True, 1.0, torch.zeros(1, dtype=torch.int32, device=DEVICE))


def test_route_tokens_takes_the_kernel_at_inference_for_few_rows_only():
    """The dispatch: never with gradients, never past KERNEL_MAX_ROWS, never on CPU tensors (the interpreter
    is for the kernel tests, not the model)."""
    from k3.ops import router

    x, W = torch.zeros(2, 8), torch.zeros(4, 8)
    assert not use_router_kernel(x, W, needs_grad=False)  # CPU
    if torch.cuda.is_available():
        from k3 import envs

        xc, Wc = x.cuda(), W.cuda()
        with envs.override(no_triton=["_router_triton"]):  # K3_NO_TRITON names it: off
            assert not use_router_kernel(xc, Wc, needs_grad=False)
        with envs.override(triton_opt_in=[]):  # on by default on CUDA (no longer in triton_dispatch.OPT_IN)
            assert use_router_kernel(xc, Wc, needs_grad=False)
            assert not use_router_kernel(xc, Wc, needs_grad=True)
            big = torch.zeros(router.KERNEL_MAX_ROWS + 1, 8, device="cuda")
            assert not use_router_kernel(big, Wc, needs_grad=False)
            assert not use_router_kernel(xc.double(), Wc, needs_grad=False)
    idx, w, scores = route_tokens(x, W, torch.zeros(4), 2)  # the reference path, on the CPU
    assert idx.tolist() == [[0, 1], [0, 1]] and torch.equal(w, torch.full((2, 2), 0.5))


def test_low_precision_logits_backward_matches_autograd_on_fp32_copies():
    """`_LowPrecisionRouterLogits` (on the CPU its fp32 GEMM stands in for CUDA's mm(out_dtype=fp32)): logits
    and ∂L/∂x, ∂L/∂W against autograd through the reference's fp32 copies, for a bf16 weight and for an fp32
    master weight; gradients land in each input's own dtype."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 96, generator=g).bfloat16()
    up = torch.randn(33, 10, generator=g)
    for w_dtype in (torch.bfloat16, torch.float32):
        W = (torch.randn(10, 96, generator=g) * 0.1).to(w_dtype)
        a = x.clone().requires_grad_()
        b = W.clone().requires_grad_()
        logits = _LowPrecisionRouterLogits.apply(a, b)
        (logits * up).sum().backward()
        ra = x.float().requires_grad_()
        rb = W.to(torch.bfloat16).float().requires_grad_()  # the values the bf16 GEMM multiplies
        ref = ra @ rb.t()
        (ref * up).sum().backward()
        assert logits.dtype == torch.float32 and a.grad.dtype == torch.bfloat16 and b.grad.dtype == w_dtype
        torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6)
        # g is rounded to bf16 before its GEMMs: each gradient is within a few bf16 roundings, as a whole
        assert rel_err(a.grad, ra.grad) < 4e-3 and rel_err(b.grad, rb.grad) < 4e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.mm(out_dtype=) has no CPU kernel")
def test_router_scores_bf16_gemm_on_cuda_matches_fp32_copies():
    """On CUDA `router_scores` of bf16 x takes mm(out_dtype=fp32): scores within fp32 rounding of the
    reference's, gradients at bf16 tolerance; K3_ROUTER_FP32 gives the reference itself."""
    from k3 import envs
    from k3.ops.router import router_scores

    g = torch.Generator().manual_seed(6)
    x = torch.randn(257, 1536, generator=g).bfloat16().cuda()
    W = (torch.randn(64, 1536, generator=g) * 0.05).bfloat16().cuda()
    up = torch.randn(257, 64, generator=g).cuda()
    outs = []
    for fp32 in (False, True):
        a, b = x.clone().requires_grad_(), W.clone().requires_grad_()
        with envs.override(router_fp32=fp32):
            s = router_scores(a, b)
        (s * up).sum().backward()
        outs.append((s, a.grad, b.grad))
    (s, dx, dw), (rs, rdx, rdw) = outs
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-6)
    assert rel_err(dx, rdx) < 4e-3 and rel_err(dw, rdw) < 4e-3


def test_router_keeps_every_ticket_workspace():
    """A CUDA graph captured with a workspace keeps writing it at each replay: a router hands out one per device
    big enough for any kernel launch, and when a larger one is ever needed the old one stays alive (freed, its
    memory could be handed to another tensor that the replayed kernel would then overwrite)."""
    from k3.model.moe import Router
    from k3.ops.router import KERNEL_MAX_ROWS

    r = Router(8, 16)
    a = r.tickets(4, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.numel() == KERNEL_MAX_ROWS and not a.any()
    assert r.tickets(KERNEL_MAX_ROWS, torch.device("cpu")) is a
    b = r.tickets(KERNEL_MAX_ROWS + 1, torch.device("cpu"))
    assert b is not a and b.numel() == KERNEL_MAX_ROWS + 1
    assert any(t is a for t in r._tickets) and r.tickets(3, torch.device("cpu")) is b


def test_kernel_compiles_for_the_h200_with_its_ticket_ordering():
    """The kernel compiled for sm_90 by ptxas (no GPU needed): one ticket atomic, acq_rel at GPU scope, issued by
    one thread right after a barrier (every thread's score stores before it), and the last program's reads of
    the row's scores from L2 (.cg), never a stale L1 line."""
    from sm90_compile import ptx_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "scores_ptr": "*fp32", "tickets_ptr": "*i32",
           "idx_ptr": "*i64", "wt_ptr": "*fp32", "E": "i32", "D": "i32", "scale": "fp32"}
    ptx = ptx_for_sm90("k3.ops._router_triton", "_router_kernel", sig, TOP_K=8, K_PAD=8, E_PAD=64,
                       RENORMALIZE=True, RANK_SELECT=True, BLOCK_E=4, BLOCK_D=2048)
    ops = [line.strip() for line in ptx.splitlines()
           if any(t in line for t in ("st.global", "bar.sync", "atom.", "ld.global.cg"))]
    atomics = [i for i, op in enumerate(ops) if "atom." in op]
    assert len(atomics) == 1 and "atom.global.gpu.acq_rel.add" in ops[atomics[0]], ops
    assert ops[atomics[0]].startswith("@%p")  # predicated: one thread draws the ticket
    assert "bar.sync" in ops[atomics[0] - 1] and "st.global" in ops[atomics[0] - 2]
    assert any("ld.global.cg" in op for op in ops[atomics[0]:])


def test_reference_scores_stay_fp32_under_autocast():
    """Autocast runs any GEMM in bf16, which would make the router's scores (and the balancing bias added to
    them for selection, ~1e-3 against bf16's 2^-9 steps near 0.5) bf16: the reference keeps its fp32 GEMM."""
    g = torch.Generator().manual_seed(8)
    x, W = torch.randn(6, 64, generator=g), torch.randn(16, 64, generator=g) * 0.1
    want = router_scores_reference(x, W)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router_scores_reference(x, W)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_scores_under_cuda_autocast_are_fp32_of_the_bf16_operands():
    """k3 train's CUDA steps: fp32 x and weight under bf16 autocast. The GEMM reads them in bf16 (as autocast
    would) but the scores are fp32: equal to float64 of the bf16-rounded operands to fp32 rounding, and their
    gradients reach the fp32 leaves."""
    from k3.ops.router import router_scores

    g = torch.Generator().manual_seed(9)
    x = torch.randn(100, 1536, generator=g).cuda().requires_grad_()
    W = (torch.randn(64, 1536, generator=g) * 0.05).cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        s = router_scores(x, W)
    want = router_scores_reference(x.detach().bfloat16().double(), W.detach().bfloat16().double())
    assert s.dtype == torch.float32 and rel_err(s, want) < 1e-6
    s.sum().backward()
    assert x.grad.dtype == W.grad.dtype == torch.float32 and x.grad.abs().sum() > 0 and W.grad.abs().sum() > 0
