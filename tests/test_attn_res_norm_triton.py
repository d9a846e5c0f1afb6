"""Inference's fused AttnRes mix (k3.ops._attn_res_norm_triton: the residual add, the mix and the RMSNorm
after it in one launch) against the separate reference ops, and the model with it and the router kernel
(k3.ops._router_triton) on: decode == the full forward == the model without them. Native on CUDA; on a CPU with
triton installed under Triton's interpreter; without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3 import envs  # noqa: E402
from k3.model.attn_res import attn_res_mix_norm  # noqa: E402
from k3.model.norm import RMSNorm  # noqa: E402
from k3.ops import triton_dispatch  # noqa: E402
from k3.ops.norm import rms_norm_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OURS = ("_router_triton", "_attn_res_norm_triton")
ROUTE_OFF = "_attn_res_route_triton"  # on by default, it takes an MoE layer's mix and router as one launch


def reference(sources, add, u, w, eps, nw, norm_eps):
    """The ops one by one, rounded to the sources' dtype between them: p' = p + add, SPEC's mix
    Σ_i softmax_i(⟨RMSNorm_u(v_i), w⟩) v_i in fp32, the RMSNorm after it."""
    sources = list(sources)
    if add is not None:
        sources[-1] = sources[-1] + add
    v = torch.stack(sources).float()
    a = torch.softmax(rms_norm_reference(v, u, eps) @ w[0].float(), dim=0)
    mix = torch.einsum("nbt,nbtd->btd", a, v).to(sources[0].dtype)
    return rms_norm_reference(mix, nw, norm_eps), sources[-1]


@pytest.mark.parametrize("n,B,T,D,dtype", [
    (1, 1, 1, 64, torch.float32),  # one source: the mix is the source
    (2, 1, 1, 1536, torch.float32),  # batch-1 decode of small
    (3, 2, 5, 96, torch.float32),  # D not a power of two
    (5, 3, 7, 200, torch.float32),  # rows not a multiple of the row block
    (4, 4, 1, 1536, torch.bfloat16),
    (2, 3, 11, 128, torch.bfloat16),
])
@pytest.mark.parametrize("with_add", [False, True])
def test_mix_norm_kernel_matches_the_separate_ops(n, B, T, D, dtype, with_add):
    """y = RMSNorm(mix) at fp32 tolerance (bf16: one rounding apart, as the kernel rounds the mix to bf16 where
    the separate ops store it); p + add bit-equal to the separate add."""
    _check_mix_norm(n, B, T, D, dtype, with_add)


@pytest.mark.parametrize("change", [dict(max_block_r=1), dict(preload=True), dict(max_block_r=1, preload=True)])
@pytest.mark.parametrize("n,B,T,D,dtype", [(3, 2, 5, 96, torch.float32), (4, 4, 1, 1536, torch.bfloat16)])
def test_every_launch_shape_matches_the_separate_ops(monkeypatch, change, n, B, T, D, dtype):
    """The decode A/B's candidates (a program a row; the sources loaded at once): the same result as the ops."""
    from k3.ops import _attn_res_norm_triton as kernels

    for key, value in change.items():
        monkeypatch.setitem(kernels.LAUNCH, key, value)
    _check_mix_norm(n, B, T, D, dtype, True)


def _check_mix_norm(n, B, T, D, dtype, with_add):
    from k3.ops import _attn_res_norm_triton as kernels

    gen = torch.Generator().manual_seed(100 * n + D)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    sources = [(r(B, T, D) * (i + 1)).to(DEVICE, dtype) for i in range(n)]  # unequal scales: a non-flat softmax
    add = r(B, T, D).to(DEVICE, dtype) if with_add else None
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (r(1, D) * 0.5).to(DEVICE)
    nw = (torch.rand(D, generator=gen) + 0.5).to(DEVICE, dtype)
    want, want_sum = reference(sources, add, u, w, 1e-5, nw, 1e-6)
    got, got_sum = kernels.mix_norm_forward(u, w, 1e-5, tuple(sources), nw, 1e-6, add)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got_sum is None) == (not with_add)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if with_add:
            assert torch.equal(got_sum, want_sum)
        return
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < 1e-2, f"relative error {err:.2e}"  # a few bf16 roundings (the sum's, the mix's) apart
    if with_add:
        torch.testing.assert_close(got_sum.float(), want_sum.float(), rtol=8e-3, atol=0)
    if DEVICE == "cuda":  # (the interpreter's fp32 → bf16 casts truncate; the GPU's round to nearest, as torch)
        # an fp32 sum in another order can move a bf16 rounding of the mix by one step, rarely
        assert (got != want).float().mean() < 0.05
        assert not with_add or torch.equal(got_sum, want_sum)


def test_attn_res_mix_norm_dispatch():
    """The layer's entry: separate ops with a gradient wanted (or on the CPU, or switched off); the kernel at
    inference; a missing p means a fresh block (the partial sum is the add itself)."""
    D = 64
    gen = torch.Generator().manual_seed(2)
    norm, out_norm = RMSNorm(D, 1e-5).to(DEVICE), RMSNorm(D, 1e-6).to(DEVICE)
    proj = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.normal_(proj.weight, std=0.3, generator=gen)  # drawn on the CPU (gen is a CPU generator)
    proj = proj.to(DEVICE)
    blocks = [torch.randn(2, 3, D, generator=gen).to(DEVICE) for _ in range(2)]
    attn = torch.randn(2, 3, D, generator=gen).to(DEVICE)
    p, y = attn_res_mix_norm(blocks, None, norm, proj, out_norm, add=attn)
    assert p is attn
    want, _ = reference(blocks + [attn], None, norm.weight, proj.weight, 1e-5, out_norm.weight, 1e-6)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert y.requires_grad  # the parameters want gradients: the autograd ops ran
    with torch.no_grad(), envs.override(triton_opt_in=OURS):  # (on CUDA the kernel)
        p2, y2 = attn_res_mix_norm(blocks[:1], blocks[1], norm, proj, out_norm, add=attn)
    want2, want_sum = reference(blocks, attn, norm.weight, proj.weight, 1e-5, out_norm.weight, 1e-6)
    assert torch.equal(p2, want_sum) and not y2.requires_grad
    torch.testing.assert_close(y2, want2.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_add", [False, True])
def test_mix_norm_kernel_compiles_as_one_custom_op(with_add):
    """Under torch.compile (fullgraph: no break around it) the launch is the one op k3::attn_res_mix_norm,
    with the eager kernel's outputs and the separate ops' values."""
    from compile_recording import recording_backend

    from k3.ops import _attn_res_norm_triton as kernels

    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    sources = tuple((r(2, 3, 96) * (i + 1)).to(DEVICE) for i in range(3))
    add = r(2, 3, 96).to(DEVICE) if with_add else None
    u, w, nw = (torch.rand(96, generator=gen) + 0.5).to(DEVICE), (r(1, 96) * 0.5).to(DEVICE), r(96).to(DEVICE)
    ops = []
    compiled = torch.compile(kernels.mix_norm_forward, backend=recording_backend(ops), fullgraph=True)
    got, got_sum = compiled(u, w, 1e-5, sources, nw, 1e-6, add)
    eager, eager_sum = kernels.mix_norm_forward(u, w, 1e-5, sources, nw, 1e-6, add)
    want, want_sum = reference(sources, add, u, w, 1e-5, nw, 1e-6)
    assert [op for op in ops if "k3." in op] == ["k3.attn_res_mix_norm"], ops
    assert torch.equal(got, eager)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if with_add:
        assert torch.equal(got_sum, eager_sum) and torch.equal(got_sum, want_sum)
    else:
        assert got_sum is None


def test_the_op_kernels_stay_chosen_inside_torch_compile():
    """Inside a compiled region (fullgraph: the selection itself traces, the kernel modules looked up without an
    import) the two custom-op kernels are chosen as in eager (on CUDA: chosen), while the training kernels'
    `use_triton` leaves the region to inductor."""
    from k3.ops.router import use_router_kernel
    from k3.ops.triton_dispatch import use_triton, use_triton_op

    x, W = torch.zeros(2, 64, device=DEVICE), torch.zeros(8, 64, device=DEVICE)

    def choices(x, W):
        return (use_router_kernel(x, W, needs_grad=False), use_triton_op(x, "_attn_res_norm_triton"),
                use_triton(x, "_attn_res_norm_triton"), use_triton(x, "_attn_res_triton"))

    with envs.override(triton_opt_in=OURS):
        eager = choices(x, W)
        torch._dynamo.reset()  # (a fresh trace of `choices`)
        seen = []

        def traced(x, W):
            seen.append(choices(x, W))  # the values the trace saw, recorded as it runs
            return x + 1

        torch.compile(traced, backend="aot_eager", fullgraph=True)(x, W)
    assert eager == (DEVICE == "cuda",) * 4
    assert seen == [(DEVICE == "cuda", DEVICE == "cuda", False, False)]


def _force_on_cpu(monkeypatch):
    """Route k3's own dispatch of the two kernels to them on CPU tensors too (the interpreter runs them)."""
    real = triton_dispatch.use_triton_op

    def use_triton_op(x, name):
        return name in OURS if x.device.type == "cpu" else real(x, name)

    import k3.model.attn_res as attn_res
    import k3.ops.router as router
    monkeypatch.setattr(attn_res, "use_triton_op", use_triton_op)
    monkeypatch.setattr(router, "use_triton_op", use_triton_op)


def _counting(monkeypatch):
    """Counts the launches of the two kernels' entry points."""
    from k3.ops import _attn_res_norm_triton, _router_triton

    calls = {"mix_norm": 0, "router": 0}
    for mod, fn, key in ((_attn_res_norm_triton, "mix_norm_forward", "mix_norm"),
                         (_router_triton, "route_tokens", "router")):
        real = getattr(mod, fn)

        def counted(*a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(*a, **k)
        monkeypatch.setattr(mod, fn, counted)
    return calls


def _tiny_case(seed: int):
    """`tiny` (fp32, eval) with non-zero AttnRes pseudo-queries (softmaxes that are not means) and ids for a
    T-token prefill and n decode steps: (cfg, model, ids, (B, T, n))."""
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(seed)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("res_proj.weight"):
                prm.normal_(0.0, 0.5)
    B, T, n = 2, 5, 3
    return cfg, model, torch.randint(0, cfg.vocab_size, (B, T + n), device=DEVICE), (B, T, n)


def test_tiny_model_decode_with_the_kernels_equals_the_full_forward(monkeypatch):
    """`tiny` (fp32) decoding token by token over a cache with the router kernel and the fused mix + norm
    (forced on, the interpreter on a CPU) gives the full forward's logits, and the same greedy picks as the
    model with them off; both kernels did run, at every mix and every MoE layer (the one launch of an MoE
    layer's mix and router, which would take them there, switched off)."""
    cfg, model, ids, (_, T, n) = _tiny_case(seed=4)
    with torch.no_grad(), envs.override(triton_opt_in=OURS, no_triton=ROUTE_OFF):
        full = model(ids).logits
        if DEVICE == "cpu":
            _force_on_cpu(monkeypatch)
        calls = _counting(monkeypatch)
        cache = model.new_cache()
        model(ids[:, :T], cache=cache)
        steps = [model(ids[:, t:t + 1], cache=cache).logits[:, 0] for t in range(T, T + n)]
    mixes = 2 * cfg.num_hidden_layers  # two a layer and the final one, none before layer 0's attention
    moe_layers = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
    forwards = n + 1  # the prefill (10 rows) too
    assert calls == {"mix_norm": mixes * forwards, "router": moe_layers * forwards}, calls
    for i, got in enumerate(steps):
        torch.testing.assert_close(got, full[:, T + i], rtol=2e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), full[:, T + i].argmax(-1))


def test_tiny_model_compiled_decode_with_the_kernels_equals_the_full_forward(monkeypatch):
    """GraphedDecodeStep's compiled core (torch.compile of the decoder stack over a StaticCache; here aot_eager,
    without the CUDA graph) with the two kernels opted in (forced on, the interpreter on a CPU): both are ops in
    the compiled graphs, and the decode's logits equal the full forward's."""
    with envs.override(no_triton=ROUTE_OFF):
        ops = compiled_tiny_decode(monkeypatch, 5, OURS, _force_on_cpu)
    assert "k3.route_tokens_decode" in ops and "k3.attn_res_mix_norm" in ops, sorted(set(ops))


def compiled_tiny_decode(monkeypatch, seed: int, opt_in: tuple, force_on_cpu) -> list[str]:
    """`tiny`'s decoder stack compiled (aot_eager) and decoded over a StaticCache with the kernel modules `opt_in`
    opted in (`force_on_cpu(monkeypatch)` routes them to the interpreter on a CPU): asserts the logits equal the full
    forward's (and its greedy picks); returns the ops the compiled graphs hold."""
    from compile_recording import recording_backend

    from k3.ops import grouped_mm
    from k3.ops.fused_linear import fuse_projections

    _, model, ids, (B, T, n) = _tiny_case(seed=seed)
    ops = []
    with torch.no_grad(), envs.override(triton_opt_in=opt_in):
        full = model(ids).logits
        if DEVICE == "cpu":
            force_on_cpu(monkeypatch)
            # the experts through the loop: torch 2.13's fake _grouped_mm takes only bf16, so Dynamo cannot trace
            # the fp32 grouped GEMMs that eager runs on the CPU
            monkeypatch.setattr(grouped_mm, "grouped_mm_supported", lambda *args: False)
        cache = model.new_cache(B, T + n)
        model(ids[:, :T], cache=cache)
        fuse_projections(model)
        core = torch.compile(model.model, backend=recording_backend(ops))
        steps = []
        for t in range(T, T + n):
            h = core(ids[:, t:t + 1], cache=cache)
            cache.advance(1)
            steps.append(model.lm_head(h[:, -1]))
    for i, got in enumerate(steps):
        torch.testing.assert_close(got, full[:, T + i], rtol=2e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), full[:, T + i].argmax(-1))
    return ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled_graph"])
def test_graphed_decode_with_the_kernels_matches_eager_and_full_forward(compile):
    """test_gpu's graphed-decode case (bf16 `tiny`, a CUDA graph per step == eager == full forward) with the
    opt-in router and mix + norm kernels on."""
    from test_gpu import _graphed_decode_case

    with envs.override(triton_opt_in=OURS):
        _graphed_decode_case(compile)


@pytest.mark.parametrize("add", [False, True])
def test_mix_norm_kernel_compiles_for_the_h200(add):
    """The forward kernel with the add and the norm on compiled for sm_90 by ptxas (no GPU needed), and without
    them (training's form): every form the dispatch can launch builds for the card."""
    from sm90_compile import ptx_for_sm90

    sig = {"srcs": ["*bf16"] * 5, "uw_ptr": "*fp32", "out_ptr": "*bf16", "scores_ptr": "*fp32", "lse_ptr": "*fp32",
           "add_ptr": "*bf16", "sum_ptr": "*bf16", "nw_ptr": "*bf16", "R": "i32", "D": "i32", "eps": "fp32",
           "norm_eps": "fp32"}
    for norm in (False, True):
        ptx = ptx_for_sm90("k3.ops._attn_res_triton", "_mix_fwd_kernel", sig, N=5, STATS=not norm, ADD=add,
                           NORM=norm, BLOCK_R=2, BLOCK_D=2048)
        assert ptx.count("st.global") >= 1 + add and ("ex2" in ptx)  # the stores (and the sum's), the softmax
