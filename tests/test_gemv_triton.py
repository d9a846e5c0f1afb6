"""Decode's GEMV kernel (k3.ops._gemv_triton) against an fp64 matmul, its selector (k3.ops.gemv.use_gemv), and a
model's decode through it against the full forward. Without CUDA the kernel runs on CPU tensors under the Triton
interpreter (which rounds fp32 → bf16 toward zero: bf16 results are held to one bf16 ulp); skipped where triton
is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from graphed_decode import bf16_tiny, graphed_decode_logits  # noqa: E402
from k3.ops import _gemv_triton, gemv  # noqa: E402
from k3.ops.fused_linear import fuse_projections  # noqa: E402
from k3.ops.gemv import DecodeLinear, force_gemv, kernel_wins, linear, use_gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rtol: one ulp of the output dtype (bf16 8 bits, fp16 11); atol: fp32 summation of K products of ~N(0, 1) values
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2 ** -7, 1e-3), torch.float16: (2 ** -10, 1e-3)}
# (M, N, K): K not a multiple of any tile, N = 1, M = 1..64; FMA, 16-row and wide tl.dot tiles, with and without
# split K
SHAPES = [(1, 1, 1), (1, 1, 300), (1, 37, 129), (2, 300, 70), (3, 100, 513), (5, 1, 700), (8, 45, 96),
          (8, 40, 1031), (13, 300, 257), (16, 7, 2000), (24, 50, 300), (64, 70, 1100)]


def operands(seed, M, N, K, dtype, bias=False, residual=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return r(M, K), r(N, K), r(N) if bias else None, r(M, N) if residual else None


def reference(x, w, b=None, res=None):
    y = x.double() @ w.double().t()
    y = y if b is None else y + b.double()
    return y if res is None else y + res.double()


def check(y, want, dtype):
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_kernel_equals_the_fp64_matmul(M, N, K, dtype):
    x, w, _, _ = operands(M * 1000 + N + K, M, N, K, dtype)
    with force_gemv(True):
        assert use_gemv(x, w)
        y = linear(x, w)
    check(y, reference(x, w), dtype)


def test_the_shapes_cover_every_launch_form():
    """The shapes above reach FMA, 16-row dot and wide dot tiles, each with K whole and split (else a path would go
    untested)."""
    forms = {(p["use_dot"] and p["block_m"] > 16, p["use_dot"], p["split"] > 1)
             for p in (_gemv_triton.plan(M, N, K, torch.bfloat16, 132) for M, N, K in SHAPES)}
    assert forms == {(wide, dot, split) for wide, dot in ((False, False), (False, True), (True, True))
                     for split in (False, True)}


@pytest.mark.parametrize("M,N,K", [(1, 37, 4500), (8, 40, 1031)])
def test_split_k_is_summed_by_each_blocks_last_split_which_leaves_the_tickets_zero(M, N, K):
    """Where K is split, the splits' sums are added by the last split of each block of N (an atomic ticket; no
    second launch): the result equals the fp64 matmul and the same bits at every call, and every ticket is back at
    zero after each call (a ticket left behind would make a later launch's wrong split sum its block). A ticket
    left far from zero on purpose is what the check catches: no split of that block draws the last ticket, so none
    sums it or resets its ticket (each adds one), while the other blocks are summed as before. (A stale ticket of 1
    is not a fixed case: on a GPU the split drawing the last ticket may find every partial already stored.)"""
    from k3.ops.triton_dispatch import ticket_workspace

    p = _gemv_triton.plan(M, N, K, torch.float32, _gemv_triton._INTERPRETER_SMS)
    assert p["split"] > 1 and not hasattr(_gemv_triton, "_reduce_splits_kernel")
    x, w, b, res = operands(M + N + K, M, N, K, torch.float32, bias=True, residual=True)
    tickets = ticket_workspace(p["n_blocks"], x.device)
    with force_gemv(True):
        first = linear(x, w, b, res)
        assert not tickets[:p["n_blocks"]].any()
        again = linear(x, w, b, res)
        assert not tickets[:p["n_blocks"]].any()
        check(first, reference(x, w, b, res), torch.float32)
        assert torch.equal(first, again)
        stale_at = 1 << 20
        tickets[p["n_blocks"] - 1] = stale_at  # block n_blocks - 1's last ticket is never drawn
        try:
            stale = linear(x, w, b, res)
            after = tickets[:p["n_blocks"]].tolist()
        finally:
            tickets.zero_()
    assert after == [0] * (p["n_blocks"] - 1) + [stale_at + p["split"]]
    cols = slice((p["n_blocks"] - 1) * p["block_n"], N)
    assert torch.equal(stale[:, :cols.start], first[:, :cols.start])


@pytest.mark.parametrize("M,N,K", [(1, 37, 129), (5, 1, 700), (8, 300, 96), (16, 7, 2000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_residual_in_the_epilogue(M, N, K, dtype):
    x, w, b, res = operands(7 + M, M, N, K, dtype, bias=True, residual=True)
    with force_gemv(True):
        assert use_gemv(x, w, b, res)
        check(linear(x, w, b, res), reference(x, w, b, res), dtype)
        check(linear(x, w, residual=res), reference(x, w, None, res), dtype)
        check(linear(x, w, b), reference(x, w, b), dtype)


def test_strided_rows_and_leading_dims():
    """Rows of x and the residual strided (slices of wider tensors, as `h[:, -1]` and the fused projection's
    outputs are), W a column block of a wider weight, x with leading dims [B, 1, K]."""
    g = torch.Generator().manual_seed(4)
    wide_x = torch.randn(3, 2, 300, generator=g).to(DEVICE)
    wide_w = torch.randn(50, 400, generator=g).to(DEVICE)
    wide_r = torch.randn(3, 2, 90, generator=g).to(DEVICE)
    x, w, res = wide_x[:, -1:, 17:217], wide_w[:, 100:300], wide_r[:, -1:, 5:55]
    assert x.stride(1) != 200 and w.stride(0) == 400
    with force_gemv(True):
        assert use_gemv(x, w, None, res)
        y = linear(x, w, residual=res)
    assert y.shape == (3, 1, 50)
    check(y, reference(x.reshape(3, 200), w, None, res.reshape(3, 50)).view(3, 1, 50), torch.float32)


def test_selector_defaults_overrides_and_refusals():
    x, w = torch.zeros(4, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    on_cuda = DEVICE == "cuda"
    assert use_gemv(x, w) == on_cuda  # on by default on CUDA (no longer in OPT_IN)
    with envs.override(triton_opt_in="_gemv_triton"):
        assert use_gemv(x, w) == on_cuda
        assert not use_gemv(x.cpu(), w.cpu())  # CPU: the plain matmul unless forced
        with envs.override(no_triton="_gemv_triton"):
            assert not use_gemv(x, w)
        with force_gemv(False):
            assert not use_gemv(x, w)
    with force_gemv(True):
        assert use_gemv(x, w) and use_gemv(x.view(4, 1, 64), w)
        assert use_gemv(torch.zeros(64, 64, device=DEVICE), w)
        assert not use_gemv(torch.zeros(65, 64, device=DEVICE), w)  # past a decode batch
        assert not use_gemv(torch.zeros(4, 17, 64, device=DEVICE), w)  # 68 rows
        assert not use_gemv(torch.zeros(0, 64, device=DEVICE), w)
        assert not use_gemv(x.double(), w.double())
        assert not use_gemv(x, w.bfloat16())  # mixed dtypes: F.linear's own error or promotion
        assert not use_gemv(x, w, residual=torch.zeros(4, 31, device=DEVICE))  # a broadcast residual
        assert not use_gemv(x, w.t().contiguous().t())  # W's rows not contiguous
        assert not use_gemv(x, torch.zeros(32, 63, device=DEVICE))  # K mismatch: F.linear raises its error
        assert not use_gemv(x, w.requires_grad_())  # a gradient is wanted
        with torch.no_grad():
            assert use_gemv(x, w)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            assert not use_gemv(x, w.detach())


def test_refused_inputs_get_the_plain_linear_and_its_errors():
    """What the kernel does not take runs F.linear: gradients flow, and a wrong width raises F.linear's error."""
    lin = DecodeLinear(64, 8).to(DEVICE)
    plain = torch.nn.Linear(64, 8).to(DEVICE)
    plain.load_state_dict(lin.state_dict())
    x = torch.randn(3, 64, device=DEVICE, requires_grad=True)
    with force_gemv(True):
        y = lin(x)
        y.square().sum().backward()
        plain(x.detach()).square().sum().backward()
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            lin(torch.zeros(2, 63, device=DEVICE))
    assert y.grad_fn is not None
    torch.testing.assert_close(lin.weight.grad, plain.weight.grad)
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_the_kernel_compiles_as_one_op():
    """torch.compile (fullgraph: no break) keeps the launch as the custom op k3::decode_gemv."""
    x, w, b, res = operands(5, 3, 40, 100, torch.float32, bias=True, residual=True)
    ops = []

    def recording(gm, example_inputs):
        ops.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with force_gemv(True), torch.no_grad():
        assert use_gemv(x, w, b, res)  # (the kernel module imported, eagerly)
        y = torch.compile(linear, backend=recording, fullgraph=True)(x, w, b, res)
    assert torch.ops.k3.decode_gemv in ops or torch.ops.k3.decode_gemv.default in ops
    check(y, reference(x, w, b, res), torch.float32)


# _gemv_kernel's arguments as a bf16 launch passes them (for the sm_90 builds below)
SM90_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
                  "part_ptr": "*fp32", "tickets_ptr": "*i32", "norm_w_ptr": "*bf16", "eps": "fp32", "up_ptr": "*bf16",
                  "beta_gate": "fp32", "beta_up": "fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                  "stride_wn": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_um": "i32"}


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_kernel_compiles_for_the_h200(rows):
    """The launch `plan` picks at 1, 8 and 64 bf16 rows, K split (o_proj's shape; at one row, whole 2048-wide K
    tiles of 4 rows of W split only past 2048 columns: [1024, 4096]), compiled for sm_90 by ptxas (no GPU
    needed): one row on the FMA units, eight and 64 on the tensor cores (an mma in the PTX); the block's last split
    sums the splits in the same launch (an atomic ticket, then the epilogue's bias and residual)."""
    from sm90_compile import ptx_for_sm90

    p = _gemv_triton.plan(rows, *((1024, 4096) if rows == 1 else (1536, 1536)), torch.bfloat16, 132)
    assert p["split"] > 1 and p["use_dot"] == (rows > 1)
    ptx = ptx_for_sm90("k3.ops._gemv_triton", "_gemv_kernel", SM90_SIGNATURE, num_warps=p["warps"], HAS_BIAS=True,
                       HAS_RES=True, HAS_NORM=False, NORM_K=2048, NORM_BLOCK=1024, HAS_GLU=False,
                       GLU_EXACT=False, SPLIT=True, USE_DOT=p["use_dot"], DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                       BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"],
                       NUM_STAGES=p["stages"])
    assert ("mma" in ptx) == p["use_dot"] and (p["use_dot"] or "fma.rn.f32" in ptx)
    assert "atom.global.gpu.acq_rel" in ptx and "ld.global.cg" in ptx and "st.global" in ptx


@pytest.mark.parametrize("rows", [16, 32, 64])
@pytest.mark.parametrize("linear", ["o_proj", "routed_up", "shared_down"])
def test_heaviest_forms_keep_their_registers(rows, linear):
    """Decode's linears with the most work around the tile (o_proj's output gate, the routed up's norm and
    residual, the shared experts' GLU), K split, at the 16-row and the wide (32, 64) tiles, specialised as a
    launch specialises its integers (multiples of 16: vectorised loads): ptxas spills nothing for sm_90."""
    from sm90_compile import registers_for_sm90

    N, K = {"o_proj": (1536, 1536), "routed_up": (1536, 768), "shared_down": (1536, 1024)}[linear]
    p = _gemv_triton.plan(rows, N, K, torch.bfloat16, 132)
    assert p["split"] > 1 and p["use_dot"]
    got = registers_for_sm90("k3.ops._gemv_triton", "_gemv_kernel", SM90_SIGNATURE, num_warps=p["warps"],
                             HAS_BIAS=False, HAS_RES=linear == "routed_up", HAS_NORM=linear == "routed_up",
                             **_gemv_triton.norm_pass(K, p["block_m"]), HAS_GLU=linear == "shared_down",
                             GLU_EXACT=False, OUT_GATE=linear == "o_proj", SPLIT=True, USE_DOT=True,
                             DOT_IN_FP32=False, BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
                             K_SPLIT=p["k_per_split"], NUM_STAGES=p["stages"],
                             divisible=("M", "N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om",
                                        "stride_um"))
    assert got["STACK"] == 0, got


@pytest.fixture
def kernel_calls(monkeypatch):
    """(rows, N, K, with residual) of each launch."""
    calls = []
    launch = gemv._launch

    def counted(x, w, b, res, *prologue):  # (prologue: the norm's or the GLU's operands, k3.ops.gemv._launch)
        calls.append((x.shape[0], w.shape[0], w.shape[1], res is not None))
        return launch(x, w, b, res, *prologue)

    monkeypatch.setattr(gemv, "_launch", counted)
    return calls


@pytest.mark.parametrize("B", [2, 24])
def test_model_decode_through_the_kernel_equals_the_full_forward(kernel_calls, monkeypatch, B):
    """fp32 tiny model: StaticCache decode with every decode linear on the kernel == the same decode on F.linear
    == the full forward; the kernel ran for the fused input projections, o_proj, the MLPs, the MoE's up
    projection with the shared experts' down (one two-segment launch), and the lm_head. At 2 rows and at a
    batch of 24 (32-row tiles)."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)  # fewer, larger programs: the interpreter's pace
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_tile_elems", 1 << 16)
    cfg = K3Config.preset("tiny")
    torch.manual_seed(3)
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    fuse_projections(model)  # the stacked input projections, as the decode drivers switch them on
    pair_weights = []
    launch_pair = gemv._launch_pair
    monkeypatch.setattr(gemv, "_launch_pair", lambda *a: pair_weights.append(id(a[6])) or launch_pair(*a))
    T, n = 7, 2
    ids = torch.randint(0, cfg.vocab_size, (B, T + n), device=DEVICE)
    steps = {}
    with torch.no_grad():
        # (the full forward and the prefill off the kernel: on CUDA it takes up to FUSED_WIN_ROWS rows by default,
        # and only the decode steps' calls are counted)
        with force_gemv(False):
            full = model(ids).logits
        for on in (True, False):
            cache = model.new_cache(B, T + n)
            with force_gemv(False):
                model(ids[:, :T], cache=cache)
            with force_gemv(on):
                steps[on] = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(T, T + n)], 1)
    D = cfg.hidden_size
    assert all(c[0] == B for c in kernel_calls)
    assert (B, cfg.vocab_size, D, False) in kernel_calls  # lm_head
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert id(moe.routed_expert_up_proj.weight) in pair_weights  # with the shared experts' down: one launch
    kda = next(layer.self_attn for layer in model.model.layers if not layer.is_mla)
    assert (B, kda.in_proj.weight.shape[0], D, False) in kernel_calls  # KDA's six input projections
    per_step = len(kernel_calls) // n
    assert len(kernel_calls) == n * per_step and per_step >= 3 * cfg.num_hidden_layers
    torch.testing.assert_close(steps[True], steps[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[True], full[:, T:], rtol=1e-4, atol=1e-4)


def test_compiled_decode_step_keeps_the_kernel_in_one_graph(monkeypatch):
    """torch.compile(fullgraph) of the tiny model's decode step over a StaticCache with the kernel forced on: one
    graph holding k3::decode_gemv, and its logits equal the eager step's."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_tile_elems", 1 << 16)
    torch.manual_seed(5)
    model = K3ForCausalLM(K3Config.preset("tiny")).to(DEVICE).eval()
    fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), device=DEVICE)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    core = torch.compile(model.model, fullgraph=True, backend=recording)
    logits = {}
    with torch.no_grad(), force_gemv(True):
        for name, step in (("eager", model.model), ("compiled", core)):
            cache = model.new_cache(2, 6)
            model(ids[:, :5], cache=cache)
            h = step(ids[:, 5:], cache=cache)
            logits[name] = model.lm_head(h[:, -1])
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert len(graphs) == 1 and any(op.startswith("k3.decode_gemv") for op in ops)
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4, 5, 8, 16])
def test_cuda_kernel_at_small_decode_shapes(M):
    """On the card (tensor cores for bf16 from 5 rows): `small`'s decode shapes against the fp64 matmul, with the
    kernel forced (opted in, it takes only the shapes where it wins)."""
    for N, K in [(6284, 1536), (1536, 1536), (1536, 768), (1536, 1024), (2304, 384), (32768, 1536)]:
        for dtype in (torch.bfloat16, torch.float32):
            x, w, b, res = operands(M + N, M, N, K, dtype, bias=True, residual=True)
            with envs.override(triton_opt_in="_gemv_triton"), torch.no_grad():
                assert use_gemv(x, w, b, res) == kernel_wins(M, N, K)
            with force_gemv(True), torch.no_grad():
                assert use_gemv(x, w, b, res)
                check(linear(x, w, b, res), reference(x, w, b, res), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [3, 12])
def test_bf16_graphed_decode_through_the_kernel(kernel_calls, B):
    """A bf16 tiny model's graphed decode (and the same compiled) with the kernel (on by default) stays within bf16
    tolerance of the graphed decode without it and of the full forward: at 3 rows (the plain linears' FMA tiles)
    and 12 (only the linears with a prologue, gemv.FUSED_WIN_ROWS, on the dot tiles)."""
    def rel_err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    model = bf16_tiny(1)
    T, n = 40, 5
    ids = torch.randint(0, model.config.vocab_size, (B, T + n), device="cuda")
    with torch.no_grad():
        full = model(ids).logits.float()
    logits = {}
    for case in ("kernel", "plain", "compiled"):
        launched = len(kernel_calls)
        with envs.override(**({"no_triton": "_gemv_triton"} if case == "plain" else {})):  # on by default
            logits[case] = graphed_decode_logits(model, ids, T, compile=case == "compiled").float()
        if case != "compiled":  # (compiled: the custom op inside the graph, not this Python seam)
            assert (len(kernel_calls) > launched) == (case == "kernel"), case
    assert rel_err(logits["kernel"], logits["plain"]) < 2e-2
    assert rel_err(logits["kernel"], full[:, T:]) < 3e-2
    assert rel_err(logits["compiled"], logits["kernel"]) < 2e-2
