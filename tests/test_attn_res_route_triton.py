"""A MoE layer's second AttnRes mix and its router in one launch (k3.ops._attn_res_route_triton) against the two
kernels it replaces and the plain references, and the model decoding with it: == the full forward, with the mix
+ norm kernel's and the router kernel's launches before MoE layers gone. Native on CUDA; on a CPU with triton
installed under Triton's interpreter; without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
triton = pytest.importorskip("triton")

from k3 import envs  # noqa: E402
from k3.model.attn_res import attn_res_mix_norm_route  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402
from k3.model.norm import RMSNorm  # noqa: E402
from k3.ops import triton_dispatch  # noqa: E402
from k3.ops.router import route, router_scores_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = "_attn_res_route_triton"
OURS = ("_router_triton", "_attn_res_norm_triton", FUSED)


def operands(seed, n, R, D, E, dtype, with_add):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    sources = [(r(R, D) * (i + 1)).to(DEVICE, dtype) for i in range(n)]  # unequal scales: a non-flat softmax
    add = r(R, D).to(DEVICE, dtype) if with_add else None
    u, w = (torch.rand(D, generator=gen) + 0.5).to(DEVICE), (r(1, D) * 0.5).to(DEVICE)
    nw = (torch.rand(D, generator=gen) + 0.5).to(DEVICE, dtype)
    rw = (r(E, D) * D ** -0.5).to(DEVICE, dtype)
    bias = (r(E) * 0.1).to(DEVICE)
    return sources, add, u, w, nw, rw, bias


@pytest.mark.parametrize("n,R,D,E,k,dtype", [
    (1, 1, 64, 16, 4, torch.float32),  # one source; tiny's router in one program
    (2, 1, 1536, 64, 8, torch.float32),  # batch-1 decode of small: 8 programs a row
    (3, 5, 200, 24, 3, torch.float32),  # D not a power of two, E not a multiple of the block
    (5, 4, 1536, 64, 8, torch.bfloat16),
    (2, 3, 128, 40, 6, torch.bfloat16),
])
@pytest.mark.parametrize("with_add", [False, True])
def test_one_launch_equals_the_mix_norm_kernel_then_the_router(n, R, D, E, k, dtype, with_add):
    """y and p + add equal the mix + norm kernel's (the same arithmetic: `_attn_res_triton._mix_rows`); the scores
    equal the fp32 router of that y; the ids and weights are the reference selection of those scores (ties to the
    lower id); the ticket workspace is left zero."""
    _check_one_launch(n, R, D, E, k, dtype, with_add)


@pytest.mark.parametrize("change", [dict(weights_first=False), dict(block_e=16, num_warps=8, weights_first=False),
                                    dict(block_e=4), dict(block_e=2, num_warps=8), dict(preload=True),
                                    dict(preload=True, weights_first=False)])
@pytest.mark.parametrize("n,R,D,E,k,dtype", [(5, 3, 1536, 64, 8, torch.float32), (2, 2, 200, 24, 3, torch.bfloat16)])
def test_every_launch_shape_gives_the_same_mix_and_routing(monkeypatch, change, n, R, D, E, k, dtype):
    """The LAUNCH entries a card's A/B picks between (the router weights loaded after the mix, more or fewer experts
    and warps a program, the sources loaded at once) leave the result as the default's: the mix + norm kernel's y,
    the router of it."""
    from k3.ops import _attn_res_route_triton

    for key, value in change.items():
        monkeypatch.setitem(_attn_res_route_triton.LAUNCH, key, value)
    block_e = _attn_res_route_triton.blocks(D, E)[1]
    assert block_e == min(change.get("block_e", 8), triton.next_power_of_2(E))  # the tile asked for, taken
    # (more warps than the mix + norm kernel's 4 sum each row in another order: fp32 a few ulps apart)
    _check_one_launch(n, R, D, E, k, dtype, True, tol=1e-6 if "num_warps" not in change else 2e-5)


def _check_one_launch(n, R, D, E, k, dtype, with_add, tol=1e-6):
    from k3.ops import _attn_res_norm_triton, _attn_res_route_triton

    sources, add, u, w, nw, rw, bias = operands(10 * n + R + D + E, n, R, D, E, dtype, with_add)
    uw = _attn_res_norm_triton.score_weight(u, w)
    tickets = torch.zeros(R, dtype=torch.int32, device=DEVICE)
    outs = _attn_res_route_triton.mix_norm_route(uw, 1e-5, sources, nw, 1e-6, add, rw, bias, tickets, k, True, 2.5)
    y, idx, weights, scores, total = outs
    want_y, want_sum = _attn_res_norm_triton.mix_norm_forward(u, w, 1e-5, tuple(sources), nw, 1e-6, add, uw=uw)
    assert total.numel() == (y.numel() if with_add else 0) and not tickets.any()
    if dtype == torch.float32:
        torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
    else:  # an fp32 sum in another order can move a bf16 rounding by one step, rarely
        assert (y != want_y).float().mean() < 0.05
    if with_add:
        assert torch.equal(total, want_sum)
    want_scores = router_scores_reference(y, rw)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)
    want_idx, want_w = route(scores, bias, k, True, 2.5)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def _moe_and_mix(D=64, E=16, k=4, seed=3):
    from k3.config import K3Config

    cfg = K3Config.preset("tiny").replace(hidden_size=D, num_experts=E, num_experts_per_token=k)
    torch.manual_seed(seed)
    moe = LatentMoE(cfg).to(DEVICE)
    torch.nn.init.normal_(moe.gate.weight, std=0.3)
    norm, out_norm = RMSNorm(D, 1e-5).to(DEVICE), RMSNorm(D, 1e-6).to(DEVICE)
    proj = torch.nn.Linear(D, 1, bias=False).to(DEVICE)
    torch.nn.init.normal_(proj.weight, std=0.3)
    return moe, norm, proj, out_norm


def _force_on_cpu(monkeypatch):
    """k3's dispatch of the three kernels on CPU tensors too (the interpreter runs them), where the K3_* switches
    let them run (`triton_dispatch.switched_on`), as on CUDA."""
    real = triton_dispatch.use_triton_op

    def use_triton_op(x, name):
        if x.device.type != "cpu":
            return real(x, name)
        return name in OURS and triton_dispatch.switched_on(name)

    import k3.model.attn_res as attn_res
    import k3.ops.router as router
    monkeypatch.setattr(attn_res, "use_triton_op", use_triton_op)
    monkeypatch.setattr(router, "use_triton_op", use_triton_op)


def test_the_entry_routes_only_where_the_one_launch_is_chosen(monkeypatch):
    """`attn_res_mix_norm_route`: with the kernel chosen, (p + attn, y, routing) where routing is the MoE's own
    `route` of y; with a gradient wanted, no MoE (a dense layer), more rows than the router kernel takes, or the
    kernel switched off: routing None and the same p', y as `attn_res_mix_norm`."""
    from k3.model.attn_res import attn_res_mix_norm
    from k3.ops.router import KERNEL_MAX_ROWS

    if DEVICE == "cpu":
        _force_on_cpu(monkeypatch)
    moe, norm, proj, out_norm = _moe_and_mix()
    gen = torch.Generator().manual_seed(4)
    blocks = [torch.randn(2, 1, 64, generator=gen).to(DEVICE) for _ in range(2)]
    attn = torch.randn(2, 1, 64, generator=gen).to(DEVICE)
    with torch.no_grad(), envs.override(triton_opt_in=OURS):
        p, y, routing = attn_res_mix_norm_route(blocks[:1], blocks[1], norm, proj, out_norm, attn, moe)
        want_p, want_y = attn_res_mix_norm(blocks[:1], blocks[1], norm, proj, out_norm, add=attn)
        assert routing is not None
        idx, w, scores = routing
        want_idx, want_w, _ = moe.route(y.reshape(-1, 64))
        assert torch.equal(idx, want_idx) and torch.equal(p, want_p)
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6)
        # a fresh block: the partial sum is attn itself
        p0, _, routing0 = attn_res_mix_norm_route(blocks, None, norm, proj, out_norm, attn, moe)
        assert p0 is attn and routing0 is not None
        assert attn_res_mix_norm_route(blocks, None, norm, proj, out_norm, attn, None)[2] is None
        many = torch.randn(KERNEL_MAX_ROWS + 1, 1, 64, generator=gen).to(DEVICE)
        assert attn_res_mix_norm_route([many], None, norm, proj, out_norm, many, moe)[2] is None
    with torch.no_grad(), envs.override(triton_opt_in=OURS, no_triton=[FUSED]):  # switched off (K3_NO_TRITON)
        assert attn_res_mix_norm_route(blocks, None, norm, proj, out_norm, attn, moe)[2] is None
    with torch.no_grad(), envs.override(triton_opt_in=[]):  # on by default (no longer in triton_dispatch.OPT_IN)
        assert attn_res_mix_norm_route(blocks, None, norm, proj, out_norm, attn, moe)[2] is not None
    with envs.override(triton_opt_in=OURS):  # the parameters want gradients: autograd's ops
        p1, y1, routing1 = attn_res_mix_norm_route(blocks, None, norm, proj, out_norm, attn, moe)
    assert routing1 is None and y1.requires_grad


def test_wide_rows_over_many_experts_are_not_fused():
    """Each of a row's programs forms the mix again, so the one launch stops at MAX_PROGRAMS_PER_ROW programs a row:
    small (D 1536, 64 experts) and tiny fit; the released widths (D 7168, 896 experts) do not."""
    from k3.ops import _attn_res_route_triton as kernels

    assert kernels.fits(1536, 64) and kernels.fits(128, 16)
    assert not kernels.fits(7168, 896)
    block_d, block_e = kernels.blocks(1536, 64)
    assert (block_d, block_e) == (2048, 8)  # the router kernel's own launch at small's widths


def test_tiny_model_decode_with_the_one_launch_equals_the_full_forward(monkeypatch):
    """`tiny` (fp32, non-flat AttnRes softmaxes) decoding token by token with the three kernels forced on: the
    full forward's logits and greedy picks; every MoE layer's second mix and router were one launch (no router
    kernel call, one mix + norm call fewer a MoE layer)."""
    from test_attn_res_norm_triton import _counting, _tiny_case

    triton_dispatch.triton_module("_attn_res_route_triton")  # (registers the op)
    cfg, model, ids, (_, T, n) = _tiny_case(seed=6)
    calls = _counting(monkeypatch)
    calls["fused"] = 0
    real_fused = triton_dispatch._op_functions["attn_res_mix_norm_route"]

    def fused(*a, **k):
        calls["fused"] += 1
        return real_fused(*a, **k)
    monkeypatch.setitem(triton_dispatch._op_functions, "attn_res_mix_norm_route", fused)
    with torch.no_grad(), envs.override(triton_opt_in=OURS):
        full = model(ids).logits
        if DEVICE == "cpu":
            _force_on_cpu(monkeypatch)
        cache = model.new_cache()
        model(ids[:, :T], cache=cache)
        steps = [model(ids[:, t:t + 1], cache=cache).logits[:, 0] for t in range(T, T + n)]
    moe_layers = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
    forwards = n + 1 + (DEVICE == "cuda")  # the prefill (10 rows) too; on a GPU the full forward's rows fit as well
    assert calls == {"mix_norm": (2 * cfg.num_hidden_layers - moe_layers) * forwards, "router": 0,
                     "fused": moe_layers * forwards}, calls
    for i, got in enumerate(steps):
        torch.testing.assert_close(got, full[:, T + i], rtol=2e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), full[:, T + i].argmax(-1))


def test_tiny_model_compiled_decode_with_the_one_launch_equals_the_full_forward(monkeypatch):
    """GraphedDecodeStep's compiled core (torch.compile of the decoder stack over a StaticCache; aot_eager here)
    with the one launch opted in: it is the op k3::attn_res_mix_norm_route in the compiled graphs (the selection
    traces without a break), no router op is left, and the logits equal the full forward's."""
    from test_attn_res_norm_triton import compiled_tiny_decode

    ops = compiled_tiny_decode(monkeypatch, 7, OURS, _force_on_cpu)
    assert "k3.attn_res_mix_norm_route" in ops and "k3.route_tokens_decode" not in ops, sorted(set(ops))


def test_one_launch_compiles_for_the_h200():
    """small's launch (5 sources, the add, 64 experts in blocks of 8, D 1536) compiled for sm_90 by ptxas (no GPU
    needed): the mix's exps, the router's sigmoid, the ticket's acquire-release atomic and the L2 read of the
    row's scores."""
    from sm90_compile import ptx_for_sm90

    sig = {"srcs": ["*bf16"] * 5, "uw_ptr": "*fp32", "add_ptr": "*bf16", "sum_ptr": "*bf16", "nw_ptr": "*bf16",
           "y_ptr": "*bf16", "rw_ptr": "*bf16", "bias_ptr": "*fp32", "scores_ptr": "*fp32", "tickets_ptr": "*i32",
           "idx_ptr": "*i64", "wt_ptr": "*fp32", "R": "i32", "D": "i32", "E": "i32", "eps": "fp32",
           "norm_eps": "fp32", "scale": "fp32"}
    ptx = ptx_for_sm90("k3.ops._attn_res_route_triton", "_mix_norm_route_kernel", sig, N=5, ADD=True, TOP_K=8,
                       K_PAD=8, E_PAD=64, RENORMALIZE=True, RANK_SELECT=True, BLOCK_E=8, BLOCK_D=2048)
    assert "ex2" in ptx and "atom.global.gpu.acq_rel" in ptx and "ld.global.cg" in ptx
    assert ptx.count("st.global") >= 4  # y, the sum, the scores, the ids and weights, the ticket's reset
