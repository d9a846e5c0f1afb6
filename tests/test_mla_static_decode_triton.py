"""MLA's absorbed decode over a StaticCache in one kernel (k3.ops._mla_static_decode_triton: the cache write, the
scores, mask, softmax and context) against the plain reference, and `tiny` decoding with it on == its full
forward == decoding with it off. Native on CUDA; on a CPU with triton installed under Triton's interpreter;
without triton the module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's import
pytest.importorskip("triton")

from k3 import envs  # noqa: E402
from k3.ops import mla_static_decode, triton_dispatch  # noqa: E402
from k3.ops.mla_static_decode import (static_decode_attention, static_decode_attention_reference,  # noqa: E402
                                      use_static_decode_kernel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OURS = "_mla_static_decode_triton"


def case(B, H, R, E, S, length, dtype, seed):
    """Inputs as the model hands them over: q_rope a slice of q's rows, the new latent and k_rope slices of
    wider rows (the fused projection's output); a cache with garbage past `length` (a slot the mask must hide)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = r(B, H, 7 + E)  # [q_nope(7) | q_rope]
    q_lat = r(B, H, R).to(DEVICE, dtype)
    q_rope = q.to(DEVICE, dtype)[..., 7:]
    kv = r(B, R + E + 3).to(DEVICE)  # [latent | k_rope | other]: the new token's, fp32 as the norm may give it
    cache_latent, cache_k_rope = r(B, S, R).to(DEVICE, dtype), r(B, S, E).to(DEVICE, dtype)
    cache_latent[:, length + 1:] = 1e4  # beyond the new token: must not count
    return (q_lat, q_rope, kv[:, :R], kv[:, R:R + E], cache_latent, cache_k_rope,
            torch.tensor(length, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-bit tile products: CUDA only (the interpreter's: wrong)")
@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_16_bit_products_match_the_reference(monkeypatch, block_n):
    """The launch's `dot16` (the tensor cores' bf16 products, the probabilities rounded to bf16 for p·latent):
    the context within bf16 tolerance of the reference, small's widths at 1 and 3 rows, a split boundary crossed."""
    from k3.ops import _mla_static_decode_triton as kernel

    monkeypatch.setitem(kernel.LAUNCH, "dot16", True)
    monkeypatch.setitem(kernel.LAUNCH, "block_n", block_n)
    for B, S, length in ((1, 4100, 4000), (3, 700, 411)):
        args = case(B, 12, 256, 64, S, length, torch.bfloat16, seed=B + block_n)
        want = static_decode_attention_reference(*[t.clone() for t in args], scale=0.0625)
        got = static_decode_attention(*args, scale=0.0625)
        err = (got.double() - want.double()).norm() / want.double().norm()
        assert err < 1e-2, (B, f"relative error {err:.2e}")


@pytest.mark.parametrize("B,H,R,E,S,length", [
    (1, 12, 256, 64, 300, 170),  # small's MLA at batch 1 (12 heads, kv rank 256, k_extra 64)
    (3, 4, 32, 16, 37, 0),  # tiny's, the first token: the context is the new token alone
    (2, 5, 40, 12, 65, 64),  # odd widths; the new token in the last slot
    (2, 19, 24, 16, 700, 411),  # two head blocks, several splits
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(B, H, R, E, S, length, dtype):
    """The context at fp32 tolerance (bf16: a few roundings), the cache holding the new token at `length` and
    nothing else changed, the ticket workspace left zero."""
    args = case(B, H, R, E, S, length, dtype, seed=B * 100 + S)
    ref_args = [t.clone() for t in args]
    want = static_decode_attention_reference(*ref_args, scale=0.125)
    got = static_decode_attention(*args, scale=0.125)
    assert got.dtype == dtype and got.shape == (B, H, R)
    new_lat, new_rope = args[2].to(dtype), args[3].to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(args[4], ref_args[4]) and torch.equal(args[5], ref_args[5])
    else:
        err = (got.double() - want.double()).norm() / want.double().norm()
        assert err < 1e-2, f"relative error {err:.2e}"
        # the interpreter's fp32 -> bf16 casts truncate where torch rounds: one bf16 step apart at most
        torch.testing.assert_close(args[4][:, length].float(), new_lat.float(), rtol=8e-3, atol=0)
        torch.testing.assert_close(args[5][:, length].float(), new_rope.float(), rtol=8e-3, atol=0)
        others = torch.ones(S, dtype=torch.bool)
        others[length] = False
        assert torch.equal(args[4][:, others], ref_args[4][:, others])
        assert torch.equal(args[5][:, others], ref_args[5][:, others])
    workspaces = [t for t in triton_dispatch._ticket_workspaces if t.device == got.device]
    assert workspaces and not any(t.any() for t in workspaces)


@pytest.mark.parametrize("B,H,R,E,S,length", [
    (1, 12, 256, 64, 300, 170),  # small's MLA at batch 1
    (3, 5, 40, 12, 65, 64),  # odd widths; the new token in the last slot
    (2, 19, 24, 16, 700, 0),  # two head blocks, several splits, the first token
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_the_latent_norm_matches_the_reference(B, H, R, E, S, length, dtype):
    """The new latent un-normalised with kv_a_layernorm's weight and eps: the context and the cache's new slot
    as the reference's (rms_norm first, then the step), at fp32 tolerance (bf16: a few roundings); the slot holds
    the normalised latent, not the raw one."""
    q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length_t = case(B, H, R, E, S, length, dtype,
                                                                                seed=7 * S + B)
    latent = (3.0 * latent + 0.5).to(dtype)  # rows far from unit RMS: the norm changes them
    g = torch.Generator().manual_seed(S)
    norm_w = (1.0 + 0.3 * torch.randn(R, generator=g)).to(DEVICE, dtype)
    args = [q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, length_t]
    ref_args = [t.clone() for t in args]
    want = static_decode_attention_reference(*ref_args, scale=0.1, norm_weight=norm_w, norm_eps=1e-6)
    got = static_decode_attention(*args, scale=0.1, norm_weight=norm_w, norm_eps=1e-6)
    normed = (latent.double() * torch.rsqrt(latent.double().pow(2).mean(-1, keepdim=True) + 1e-6)
              * norm_w.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(cache_latent[:, length].double(), normed, **tol)
    torch.testing.assert_close(ref_args[4][:, length].double(), normed, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        err = (got.double() - want.double()).norm() / want.double().norm()
        assert err < 1e-2, f"relative error {err:.2e}"


def test_kernel_refuses_a_norm_weight_of_another_width():
    args = case(2, 4, 32, 16, 50, 20, torch.float32, seed=9)
    with pytest.raises(ValueError, match="norm_weight must be"):
        static_decode_attention(*args, scale=1.0, norm_weight=torch.ones(31, device=DEVICE))


def test_kernel_compiles_as_one_custom_op():
    """Under torch.compile (fullgraph) the launch is the one op k3::mla_static_decode, with the eager kernel's
    context and cache write."""
    from compile_recording import recording_backend

    args = case(2, 4, 32, 16, 50, 20, torch.float32, seed=3)
    eager_args = [t.clone() for t in args]
    ops = []
    compiled = torch.compile(static_decode_attention, backend=recording_backend(ops), fullgraph=True)
    got = compiled(*args, scale=0.2)
    eager = static_decode_attention(*eager_args, scale=0.2)
    assert [op for op in ops if "k3." in op] == ["k3.mla_static_decode"], ops
    assert torch.equal(got, eager)
    assert torch.equal(args[4], eager_args[4]) and torch.equal(args[5], eager_args[5])


def test_kernel_refuses_mismatched_inputs():
    args = list(case(2, 4, 32, 16, 50, 20, torch.float32, seed=4))
    bad_shape = list(args)
    bad_shape[2] = args[2][:, :31]
    with pytest.raises(ValueError, match="latent must be"):
        static_decode_attention(*bad_shape, scale=1.0)
    bad_dtype = list(args)
    bad_dtype[0] = args[0].double()
    with pytest.raises(ValueError, match="one dtype"):
        static_decode_attention(*bad_dtype, scale=1.0)
    strided = list(args)
    strided[4] = args[4].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="cache_latent must be contiguous"):
        static_decode_attention(*strided, scale=1.0)


def test_a_full_cache_is_neither_written_nor_read_past_its_end():
    """A length at the cache's capacity (the caller's check bypassed, as a captured graph replayed once too often
    would): the kernel writes nothing and reads only the cache (no memory past it), the context that of its S
    tokens."""
    q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, _ = case(2, 4, 32, 16, 40, 39, torch.float32, seed=5)
    full = torch.tensor(40, device=DEVICE)
    before = cache_latent.clone(), cache_k_rope.clone()
    got = static_decode_attention(q_lat, q_rope, latent, k_rope, cache_latent, cache_k_rope, full, scale=0.1)
    assert torch.equal(cache_latent, before[0]) and torch.equal(cache_k_rope, before[1])
    scores = (torch.einsum("bhr,bsr->bhs", q_lat, cache_latent) + torch.einsum("bhe,bse->bhs", q_rope, cache_k_rope))
    want = torch.einsum("bhs,bsr->bhr", torch.softmax(scores * 0.1, -1), cache_latent)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_model_refuses_a_decode_past_the_static_cache(monkeypatch):
    """With the kernel forced on, a step into a full StaticCache is the cache's ValueError, nothing written."""
    _, model, ids, (B, T, _) = _tiny(seed=8, steps=1)
    if DEVICE == "cpu":
        monkeypatch.setattr(mla_static_decode, "use_triton_op", lambda x, name: name == OURS)
    with torch.no_grad(), envs.override(triton_opt_in=[OURS]):
        cache = model.new_cache(B, T)
        model(ids[:, :T], cache=cache)
        latents = [s.latent.clone() for s in cache.layers if hasattr(s, "latent")]
        with pytest.raises(ValueError, match="StaticCache holds"):
            model(ids[:, T:T + 1], cache=cache)
    assert all(torch.equal(a, s.latent) for a, s in zip(latents, [s for s in cache.layers if hasattr(s, "latent")]))


def test_dispatch_is_cuda_inference_only():
    """Never with a gradient or on CPU tensors; on CUDA by default (timed on an H200), off where K3_NO_TRITON names
    it."""
    x = torch.zeros(1, 2, 8)
    assert not use_static_decode_kernel(x, torch.zeros(1, 4, 8), needs_grad=False)  # CPU
    if DEVICE == "cuda":
        xc, cache = x.cuda(), torch.zeros(1, 4, 8, device="cuda")
        with envs.override(no_triton=[OURS]):
            assert not use_static_decode_kernel(xc, cache, needs_grad=False)
        with envs.override(triton_opt_in=[]):  # no longer in triton_dispatch.OPT_IN
            assert use_static_decode_kernel(xc, cache, needs_grad=False)
            assert not use_static_decode_kernel(xc, cache, needs_grad=True)
            assert not use_static_decode_kernel(xc, cache.bfloat16(), needs_grad=False)


def _tiny(seed, steps):
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(seed)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    B, T, n = 2, 5, steps
    return cfg, model, torch.randint(0, cfg.vocab_size, (B, T + n), device=DEVICE), (B, T, n)


@pytest.mark.parametrize("absorbed", [False, True], ids=["q_b", "absorbed_q"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tiny_decode_with_the_kernel_equals_the_full_forward(monkeypatch, compiled, absorbed):
    """`tiny` (fp32) decoding over a StaticCache with the kernel forced on (the interpreter on a CPU): the full
    forward's logits and the same greedy picks as decoding with it off; it ran at every MLA layer and step
    (compiled: GraphedDecodeStep's core under torch.compile, aot_eager, where it is an op of the graph).
    absorbed: the kept weights switched on (fuse_projections), so q_b and W_UK are one GEMM and q_b_proj is not
    called in the decode steps."""
    from k3.ops.fused_linear import fuse_projections
    from compile_recording import recording_backend

    from k3.ops import grouped_mm

    cfg, model, ids, (B, T, n) = _tiny(seed=6, steps=2 if compiled else 4)
    calls = []
    real = mla_static_decode.static_decode_attention

    def counted(*a, **k):
        calls.append(a[8] if len(a) > 8 else k.get("norm_weight"))  # kv_a_layernorm's weight: the kernel's
        return real(*a, **k)

    def decode(kernel_on, compiled=False):
        cache = model.new_cache(B, T + n)
        model(ids[:, :T], cache=cache)
        with monkeypatch.context() as m:
            if kernel_on:
                if DEVICE == "cpu":
                    m.setattr(mla_static_decode, "use_triton_op", lambda x, name: name == OURS)
                m.setattr("k3.model.mla.static_decode_attention", counted)
            if compiled:  # (torch 2.13's fake _grouped_mm takes only bf16: the experts through the loop)
                m.setattr(grouped_mm, "grouped_mm_supported", lambda *args: False)
                core = torch.compile(model.model, backend=recording_backend(ops))
            steps = []
            for t in range(T, T + n):
                if compiled:
                    h = core(ids[:, t:t + 1], cache=cache)
                    cache.advance(1)
                    steps.append(model.lm_head(h[:, -1]))
                else:
                    steps.append(model(ids[:, t:t + 1], cache=cache).logits[:, 0])
            torch._dynamo.reset()
        return steps

    ops = []
    with torch.no_grad(), envs.override(triton_opt_in=[OURS]):
        full = model(ids).logits
        off = decode(kernel_on=False)
        assert not calls
        q_b_calls = []
        if absorbed:
            fuse_projections(model)
            for layer in model.model.layers:
                if layer.is_mla:
                    layer.self_attn.q_b_proj.register_forward_hook(lambda *a: q_b_calls.append(1))
        on = decode(kernel_on=True, compiled=compiled)
    # the prefill calls q_b_proj once a layer; the decode steps only without the fold
    assert len(q_b_calls) == (len(cfg.mla_layer_ids) if absorbed else 0)
    mla_layers = len(cfg.mla_layer_ids)
    assert mla_layers > 0
    if compiled:
        assert "k3.mla_static_decode" in ops, sorted(set(ops))
    else:
        assert len(calls) == mla_layers * n
        norms = [layer.self_attn.kv_a_layernorm.weight for layer in model.model.layers if layer.is_mla]
        assert all(any(w is nw for nw in norms) for w in calls)  # the norm went into the kernel
    for i, (got, base) in enumerate(zip(on, off)):
        torch.testing.assert_close(got, full[:, T + i], rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), base.argmax(-1))


def _sm90_case(norm: bool, dot16: bool = True, block_n: int = 64) -> tuple[dict, dict]:
    """(signature, constexprs) of the kernel at small's widths in bf16, with or without the latent's norm, with
    bf16 products (dot16, the launch's default) or tf32 products of fp32 tiles, `block_n` tokens a tile."""
    sig = {"q_lat_ptr": "*bf16", "q_lat_row": "i32", "q_lat_head": "i32", "q_rope_ptr": "*bf16",
           "q_rope_row": "i32", "q_rope_head": "i32", "new_lat_ptr": "*bf16", "new_lat_row": "i32",
           "new_rope_ptr": "*bf16", "new_rope_row": "i32", "lat_ptr": "*bf16", "rope_ptr": "*bf16",
           "length_ptr": "*i64", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "tickets_ptr": "*i32",
           "out_ptr": "*bf16", "norm_w_ptr": "*bf16", "norm_eps": "fp32", "H": "i32", "R": "i32", "E": "i32",
           "max_len": "i32", "scale": "fp32", "split_len": "i32", "splits": "i32", "head_blocks": "i32"}
    # as a launch at small's widths specialises: the integers that are multiples of 16 (q's rows and heads, the
    # new latent's row in the fused projection, 704, the widths, the split; not the cache's length or the heads)
    return sig, dict(BLOCK_H=16, BLOCK_R=256, BLOCK_E=64, BLOCK_N=block_n, BLOCK_S=32, PRECISION="tf32",
                     NORM=norm, DOT16=dot16,
                     divisible=("q_lat_row", "q_lat_head", "q_rope_row", "q_rope_head", "new_lat_row",
                                "new_rope_row", "R", "E", "split_len"))


@pytest.mark.parametrize("dot16", [False, True], ids=["tf32", "bf16"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "latent_norm"])
def test_kernel_compiles_for_the_h200(norm, dot16):
    """The kernel compiled for sm_90 by ptxas (no GPU needed) at small's widths in bf16, with and without the
    latent's norm folded in: the merge's ticket is an acquire-release atomic, the partials are read back from L2,
    and the products run on the tensor cores, on tf32 or (dot16) bf16 operands."""
    from sm90_compile import ptx_for_sm90

    sig, consts = _sm90_case(norm, dot16)
    ptx = ptx_for_sm90("k3.ops._mla_static_decode_triton", "_static_decode_kernel", sig, num_warps=8, **consts)
    assert "atom.global.gpu.acq_rel" in ptx and "ld.global.cg" in ptx
    mma = [line for line in ptx.splitlines() if "mma" in line and ".f32" in line]
    assert mma and all((".bf16" in line) == dot16 and (".tf32" in line) != dot16 for line in mma), mma[:2]


@pytest.mark.parametrize("norm", [False, pytest.param(True, marks=pytest.mark.xfail(strict=True, reason=(
    "with the latent's norm (the model's launch) ptxas spills 8 B a thread at the default launch (255 registers, "
    "8 warps, one CTA an SM); the decode step was timed with it (session 29: batch 64 3.57 -> 3.32 ms)")))],
    ids=["plain", "latent_norm"])
def test_kernel_does_not_spill_on_the_h200(norm):
    """ptxas's allocation for sm_90 at the default launch (bf16 products, 64-token tiles): no spills."""
    from sm90_compile import registers_for_sm90

    sig, consts = _sm90_case(norm)
    assert registers_for_sm90("k3.ops._mla_static_decode_triton", "_static_decode_kernel", sig, num_warps=8,
                              **consts)["STACK"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled_graph"])
def test_graphed_decode_with_the_kernel_matches_eager_and_full_forward(compile):
    """test_gpu's graphed-decode case (bf16 `tiny`, a CUDA graph per step == eager == full forward) with the
    kernel opted in: the write at the device length and the merge's workspace replay as captured."""
    from test_gpu import _graphed_decode_case

    with envs.override(triton_opt_in=[OURS]):
        _graphed_decode_case(compile)


@pytest.mark.parametrize("seed", [0, 1])
def test_absorbed_query_weight_equals_q_b_then_w_uk_and_follows_a_load(seed):
    """MLA's kept absorbed query weight (k3.model.mla.AbsorbedQueryWeight) in float64, odd widths: its GEMM gives
    each head's q_nope·W_UK and q_rope as q_b_proj then the per-head product do; after a weight load (in place)
    the kept tensor follows, in the same storage (a captured graph stays valid)."""
    from torch import nn

    from k3.model.mla import AbsorbedQueryWeight

    torch.manual_seed(seed)
    H, nope, rope, R, Q, v = 3, 5, 3, 7, 11, 4
    q_b = nn.Linear(Q, H * (nope + rope), bias=False).double()
    kv_b = nn.Linear(R, H * (nope + v), bias=False).double()
    kept = AbsorbedQueryWeight(q_b, kv_b, nope, rope, R)
    kept.refresh()
    x = torch.randn(2, Q, dtype=torch.float64)

    def want():
        q = (x @ q_b.weight.T).view(2, H, nope + rope)
        w_uk = kv_b.weight.view(H, nope + v, R)[:, :nope]
        return torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk), q[..., nope:]

    with torch.no_grad():  # (with a gradient wanted the weight is made afresh, not kept)
        for _ in range(2):
            got = (x @ kept.current().T).view(2, H, R + rope)
            q_lat, q_rope = want()
            torch.testing.assert_close(got[..., :R], q_lat, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[..., R:], q_rope, rtol=1e-12, atol=1e-12)
            ptr = kept.weight.data_ptr()
            q_b.weight.copy_(torch.randn_like(q_b.weight))
            kv_b.weight.copy_(torch.randn_like(kv_b.weight))
            assert kept.current().data_ptr() == ptr


def test_absorbed_query_through_the_gemv_with_the_q_a_norm(monkeypatch):
    """The fold with the decode GEMV forced (the interpreter on a CPU): the absorbed weight's GEMM takes the q_a
    norm in the kernel's prologue; `tiny`'s decode steps equal its full forward, and the GEMM ran at every MLA
    layer and step with the absorbed shape [H·(kv_rank+rope), q_lora_rank]."""
    import k3.model.mla as mla
    from k3.ops import gemv
    from k3.ops.fused_linear import fuse_projections

    cfg, model, ids, (B, T, n) = _tiny(seed=9, steps=2)
    if DEVICE == "cpu":
        monkeypatch.setattr(mla_static_decode, "use_triton_op", lambda x, name: name == OURS)
    launched = []
    real = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: (launched.append(tuple(a[1].shape)), real(*a, **k))[1])
    with torch.no_grad(), envs.override(triton_opt_in=[OURS, "_gemv_triton"]), gemv.force_gemv(True):
        full = model(ids).logits
        fuse_projections(model)
        cache = model.new_cache(B, T + n)
        model(ids[:, :T], cache=cache)
        launched.clear()
        steps = [model(ids[:, t:t + 1], cache=cache).logits[:, 0] for t in range(T, T + n)]
    absorbed = (cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim), cfg.q_lora_rank)
    assert launched.count(absorbed) == len(cfg.mla_layer_ids) * n
    for i, got in enumerate(steps):
        torch.testing.assert_close(got, full[:, T + i], rtol=2e-4, atol=2e-4)
