"""KDA's decode step as one kernel (k3.ops._kda_decode_triton) against its plain-PyTorch reference
(k3.ops.kda_decode.kda_decode_step_reference), and the model's decode through it against the full forward and
the unfused decode: a StaticCache's rows and the serving pool's slot table (with holes and padding rows).
Without CUDA the kernel runs on CPU under the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

import k3.model.kda as kda_model  # noqa: E402
from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from graphed_decode import bf16_tiny, graphed_decode_logits  # noqa: E402
from k3.ops import kda_decode, triton_dispatch  # noqa: E402
from k3.ops.kda_core import force_backend  # noqa: E402
from k3.ops.triton_dispatch import triton_module  # noqa: E402
from k3.ops.kda_decode import (DecodeWeights, force_fused_decode, kda_decode_step,  # noqa: E402
                               kda_decode_step_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def step_case(seed, B, H, K, V, R, W, n_slots, dtype=torch.float32):
    """Inputs as the fused projection hands them (strided column slices of one [B, 1, total] GEMM output), the
    layer's weights, and storage of n_slots slots: state [N, H, K, V] and the three tails as the serving pool
    holds them when K == V (views of one [N, 3, W−1, C] buffer), separate buffers otherwise."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    widths = [H * K, H * K, H * V, R, H, H * V]
    feats = [t[:, 0] for t in (r(B, 1, sum(widths)) * 1.5).to(dtype).to(DEVICE).split(widths, -1)]
    assert feats[0].stride(0) == sum(widths)  # rows strided by the whole projection
    weights = DecodeWeights(conv_q=r(H * K, 1, W) * 0.6, conv_k=r(H * K, 1, W) * 0.6, conv_v=r(H * V, 1, W) * 0.6,
                            f_b=(r(H * K, R) * R ** -0.5).to(dtype), A_log=r(H + 3) * 0.5,  # padded, as released
                            dt_bias=r(H * K), norm_weight=1 + 0.3 * r(V), lower_bound=-5.0, eps=1e-5)
    weights = DecodeWeights(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in vars(weights).values()))
    state = (r(n_slots, H, K, V) * 0.3).to(DEVICE)
    if K == V:
        pool = r(n_slots, 3, W - 1, H * K).to(DEVICE)
        tails = (pool[:, 0], pool[:, 1], pool[:, 2])
    else:
        tails = tuple(r(n_slots, W - 1, c).to(DEVICE) for c in (H * K, H * K, H * V))
    return feats, weights, state, tails


def run_both(feats, weights, state, tails, slots):
    """(kernel's output, state, tails) and (reference's ...), each on its own copy of the storage."""
    results = []
    for fn in (kda_decode_step, kda_decode_step_reference):
        st, tl = state.clone(), tuple(t.clone() for t in tails)
        out = fn(*feats, weights, st, *tl, slots)
        results.append((out, st, tl))
    return results


@pytest.fixture(params=["one program a head", "columns split"])
def column_splits(request, monkeypatch):
    """The kernel's launch with each head in one program, or its state columns split over as many programs as
    8-column tiles allow (the last program to finish stores the q/k tails and the norm): the expected splits."""
    kernels = triton_module("_kda_decode_triton")
    if request.param == "columns split":
        monkeypatch.setitem(kernels.LAUNCH, "tile_v", 8)
        monkeypatch.setitem(kernels.LAUNCH, "programs_per_sm", 1000)
        return lambda V: max(1, triton.next_power_of_2(V) // 8)
    monkeypatch.setitem(kernels.LAUNCH, "programs_per_sm", 0)
    return lambda V: 1


@pytest.mark.parametrize("B,H,K,V,R,W", [(1, 2, 16, 16, 16, 4), (3, 3, 32, 32, 32, 4), (2, 2, 16, 8, 12, 3),
                                         (4, 1, 24, 24, 16, 4), (2, 2, 128, 128, 128, 4)])
@pytest.mark.parametrize("with_slots", [False, True])
def test_kernel_equals_the_reference_step(B, H, K, V, R, W, with_slots, column_splits):
    """fp32: output and state to rounding, tails exactly; with a slot table with holes (rows in another order
    than the slots, slots skipped) every slot no row names is left bit for bit as it was. Split over programs,
    the same, and the ticket workspace left zero."""
    kernels = triton_module("_kda_decode_triton")
    assert kernels.column_splits(B * H, triton.next_power_of_2(V), torch.device(DEVICE)) == column_splits(V)
    n_slots = 2 * B + 3 if with_slots else B
    feats, weights, state, tails = step_case(B * 100 + H * 10 + K, B, H, K, V, R, W, n_slots)
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(B))[:B].to(DEVICE) if with_slots else None
    (out, st, tl), (want, want_st, want_tl) = run_both(feats, weights, state, tails, slots)
    assert out.shape == (B, H * V) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(st, want_st, rtol=2e-5, atol=2e-5)
    for got, ref, old in zip(tl, want_tl, tails):
        assert torch.equal(got, ref) and not torch.equal(got, old)
    touched = slots if with_slots else torch.arange(B, device=DEVICE)
    untouched = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    untouched[touched] = False
    assert torch.equal(st[untouched], state[untouched]) and not torch.equal(st[touched], state[touched])
    for got, old in zip(tl, tails):
        assert torch.equal(got[untouched], old[untouched])
    assert not any(t.any() for t in triton_dispatch._ticket_workspaces)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_keep_fp32_state_math(dtype):
    """16-bit projections: the kernel and the reference read the same values and compute in fp32, so the fp32
    state agrees to rounding and the output to its own dtype's rounding."""
    feats, weights, state, tails = step_case(7, 3, 2, 32, 32, 32, 4, 5, dtype)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    (out, st, tl), (want, want_st, want_tl) = run_both(feats, weights, state, tails, slots)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(st, want_st, rtol=2e-5, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(tl, want_tl))


def test_steps_chain_like_the_recurrence(column_splits):
    """Five steps in a row through the same storage (each reading the tails and state the last one wrote)."""
    B, H, K, W = 2, 2, 16, 4
    feats, weights, state, tails = step_case(11, B, H, K, K, K, W, B)
    ref_state, ref_tails = state.clone(), tuple(t.clone() for t in tails)
    g = torch.Generator().manual_seed(12)
    for _ in range(5):
        step = [(torch.randn(f.shape, generator=g) * 1.5).to(DEVICE) for f in feats]
        out = kda_decode_step(*step, weights, state, *tails)
        want = kda_decode_step_reference(*step, weights, ref_state, *ref_tails)
        torch.testing.assert_close(out, want, rtol=5e-5, atol=5e-5)
    torch.testing.assert_close(state, ref_state, rtol=5e-5, atol=5e-5)


def test_slots_outside_the_storage_touch_nothing():
    """A slot table naming slots past the storage or below 0 (a caller's bug; checking it would cost a device
    read) makes the kernel read zeros for those rows and write nothing for them: the storage outside the valid
    rows' slots stays bit for bit, the valid row gets the reference's result, and every output is finite."""
    feats, weights, state, tails = step_case(21, 3, 2, 16, 16, 16, 4, 4)
    before = (state.clone(), tuple(t.clone() for t in tails))
    out = kda_decode_step(*feats, weights, state, *tails, torch.tensor([9, 2, -1], device=DEVICE))
    ref_state, ref_tails = before[0].clone(), tuple(t.clone() for t in before[1])
    want = kda_decode_step_reference(*(f[1:2] for f in feats), weights, ref_state, *ref_tails,
                                     torch.tensor([2], device=DEVICE))
    torch.testing.assert_close(out[1:2], want, rtol=2e-5, atol=2e-5)
    assert torch.isfinite(out).all()
    others = torch.tensor([0, 1, 3], device=DEVICE)
    assert torch.equal(state[others], before[0][others])
    torch.testing.assert_close(state[2], ref_state[2], rtol=2e-5, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(tails, ref_tails))


def test_bad_inputs_are_refused_by_name():
    feats, weights, state, tails = step_case(3, 2, 2, 16, 16, 16, 4, 4)
    with pytest.raises(ValueError, match="slots"):
        kda_decode_step(*feats, weights, state, *tails, torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="state"):
        kda_decode_step(*feats, weights, state.double(), *tails, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="xv"):
        kda_decode_step(feats[0], feats[1], feats[2][:, :-1], *feats[3:], weights, state, *tails,
                        torch.tensor([0, 1], device=DEVICE))
    strided = feats[0].t().contiguous().t()  # same values, columns not contiguous
    with pytest.raises(ValueError, match="xq"):
        kda_decode_step(strided, *feats[1:], weights, state, *tails, torch.tensor([0, 1], device=DEVICE))


def test_selector_defaults_overrides_and_refusals():
    x = torch.zeros(2, 64)
    state = torch.zeros(2, 2, 32, 32)
    default = DEVICE == "cuda" and triton_dispatch.switched_on("_kda_decode_triton")
    assert kda_decode.use_fused_decode(x.to(DEVICE), state.to(DEVICE), (32, 32), 4, needs_grad=False) == default
    assert not kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=False)  # CPU: the unfused path
    with force_fused_decode(True):
        assert kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=False)
        assert not kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=True)  # no backward
        assert not kda_decode.use_fused_decode(x, state.double(), (32, 32), 4, needs_grad=False)
        assert not kda_decode.use_fused_decode(x, state, (256, 256), 4, needs_grad=False)  # past one tile
    with force_fused_decode(False):
        assert not kda_decode.use_fused_decode(x.to(DEVICE), state.to(DEVICE), (32, 32), 4, needs_grad=False)
    with force_backend("reference"):  # a test pinning every KDA core pins the decode step too
        assert not kda_decode.use_fused_decode(x.to(DEVICE), state.to(DEVICE), (32, 32), 4, needs_grad=False)
    with envs.override(no_triton="_kda_decode_triton"):
        assert not kda_decode.use_fused_decode(x.to(DEVICE), state.to(DEVICE), (32, 32), 4, needs_grad=False)


def test_an_opt_in_listing_holds_the_kernel_back_until_named(monkeypatch):
    """Listed in triton_dispatch.OPT_IN (the untimed kernels), it runs only where K3_TRITON names it."""
    x, state = torch.zeros(2, 64, device=DEVICE), torch.zeros(2, 2, 32, 32, device=DEVICE)
    monkeypatch.setattr(triton_dispatch, "OPT_IN", frozenset({"_kda_decode_triton"}))
    assert not kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=False)
    with envs.override(triton_opt_in="_kda_decode_triton"):
        assert kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=False) == (DEVICE == "cuda")
    with envs.override(triton_opt_in="_kda_decode_triton", no_triton="_kda_decode_triton"):  # off wins
        assert not kda_decode.use_fused_decode(x, state, (32, 32), 4, needs_grad=False)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the layer's launches of the fused step."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kda_decode_step(*args, **kwargs)

    monkeypatch.setattr(kda_model, "kda_decode_step", counted)
    return calls


def test_model_decode_through_the_kernel_equals_full_forward_and_unfused_decode(kernel_calls):
    """fp32 tiny model: StaticCache decode with the kernel == the same decode unfused == the full forward."""
    cfg = K3Config.preset("tiny")
    torch.manual_seed(3)
    model = K3ForCausalLM(cfg).to(DEVICE).eval()
    B, T, n = 2, 7, 4
    ids = torch.randint(0, cfg.vocab_size, (B, T + n), device=DEVICE)
    kda_layers = sum(not cfg.is_mla(l) for l in range(cfg.num_hidden_layers))
    with torch.no_grad():
        full = model(ids).logits
        steps = {}
        for fused in (True, False):
            cache = model.new_cache(B, T + n)
            model(ids[:, :T], cache=cache)
            with force_fused_decode(fused):
                steps[fused] = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(T, T + n)], 1)
            steps[fused, "state"] = [cache.layers[l].state.clone() for l in range(cfg.num_hidden_layers)
                                     if not cfg.is_mla(l)]
    assert kernel_calls == [B] * (kda_layers * n)
    torch.testing.assert_close(steps[True], steps[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[True], full[:, T:], rtol=1e-4, atol=1e-4)
    for a, b in zip(steps[True, "state"], steps[False, "state"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_engine_decode_steps_through_the_kernel_equal_the_unfused_engine(kernel_calls):
    """The serving engine's fixed-shape decode steps (rows padded onto the scratch slot, slots freed as requests
    finish, so the slot table has holes) through the kernel give the unfused engine's greedy tokens and
    logprobs; steps that mix prefill chunks take the unfused path."""
    from k3.serve import EngineConfig, LLMEngine, SamplingParams

    torch.manual_seed(2)
    model = K3ForCausalLM(K3Config.preset("tiny")).to(DEVICE).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 8000, (n,), generator=gen).tolist() for n in (3, 9, 17, 2)]
    max_tokens = [6, 2, 4, 8]
    outs = {}
    for fused in (True, False):
        eng = LLMEngine(model, None, EngineConfig(memory_bytes=64 << 20, block_size=16, match_unit=4,
                                                  max_batch_tokens=64, max_num_seqs=8, decode_graphs=True))
        ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, logprobs=1))
               for p, n in zip(prompts, max_tokens)]
        tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
        with force_fused_decode(fused):
            while eng.has_unfinished():
                for o in eng.step():
                    tokens[o.request_id] += o.new_token_ids
                    logprobs[o.request_id] += [lp.logprob for lp in o.new_logprobs]
        outs[fused] = [(tokens[i], logprobs[i]) for i in ids]
        eng.close()
    assert kernel_calls and all(n in (1, 2, 4) for n in kernel_calls)  # padded batch sizes
    for (ids_a, lp_a), (ids_b, lp_b), n in zip(outs[True], outs[False], max_tokens):
        assert ids_a == ids_b and len(ids_a) == n
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_graphed_decode_takes_the_kernel_and_matches_the_unfused_step(kernel_calls):
    """On CUDA the default selection takes the kernel; a bf16 model's graphed decode (and the same compiled)
    stays within bf16 tolerance of the unfused graphed decode (K3_NO_TRITON=_kda_decode_triton) and of the
    full forward."""
    def rel_err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    model = bf16_tiny(1)
    B, T, n = 3, 40, 5
    ids = torch.randint(0, model.config.vocab_size, (B, T + n), device="cuda")
    with torch.no_grad():
        full = model(ids).logits.float()
    logits = {}
    for case in ("fused", "unfused", "compiled"):
        with envs.override(no_triton="_kda_decode_triton" if case == "unfused" else frozenset(),
                           triton_opt_in="_kda_decode_triton"):  # (taken even if listed as opt-in)
            logits[case] = graphed_decode_logits(model, ids, T, compile=case == "compiled").float()
        if case == "fused":
            assert kernel_calls, "the default selection did not take the kernel on CUDA"
    assert rel_err(logits["fused"], logits["unfused"]) < 2e-2
    assert rel_err(logits["fused"], full[:, T:]) < 3e-2
    assert rel_err(logits["compiled"], logits["fused"]) < 2e-2


def test_the_step_compiles_as_one_op_that_writes_the_storage():
    """Under torch.compile (fullgraph: no break around it) the step is one custom op whose in-place writes of
    the state and tails reach the caller's buffers, as in eager."""
    feats, weights, state, tails = step_case(9, 2, 2, 16, 16, 16, 4, 5)
    slots = torch.tensor([3, 1], device=DEVICE)
    ref_state, ref_tails = state.clone(), tuple(t.clone() for t in tails)
    kda_decode.use_fused_decode(feats[0], state, (16, 16), 4, needs_grad=False)  # the kernels imported, eagerly
    step = torch.compile(kda_decode_step, backend="aot_eager", fullgraph=True)
    out = step(*feats, weights, state, *tails, slots)
    want = kda_decode_step_reference(*feats, weights, ref_state, *ref_tails, slots)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, ref_state, rtol=2e-5, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(tails, ref_tails))


def _sm90_case(splits: int) -> tuple[dict, dict]:
    """(signature, constexprs) of the kernel at small's widths (12 heads of 128, the gate's rank 128, 4 taps) in
    bf16 with its state columns split over `splits` programs."""
    ptrs = ["xq_ptr", "xk_ptr", "xv_ptr", "fa_ptr", "beta_ptr", "gate_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "fb_ptr",
            "A_log_ptr", "dt_bias_ptr", "norm_w_ptr", "out_ptr"]
    sig = {**{n: "*bf16" for n in ptrs}, **{n: "*fp32" for n in ("state_ptr", "tq_ptr", "tk_ptr", "tv_ptr",
                                                                    "sum_sq_ptr")},
           "slots_ptr": "*i64", "tickets_ptr": "*i32",
           **{n: "i32" for n in ("sx_q", "sx_k", "sx_v", "s_fa", "s_beta", "s_gate", "s_state", "s_tq", "s_tk",
                                 "s_tv", "r_tq", "r_tk", "r_tv", "n_slots", "H", "K", "V", "R")},
           "scale": "fp32", "lower_bound": "fp32", "eps": "fp32"}
    consts = dict(W=4, HAS_SLOTS=True, TAIL_ROWS=4, BLOCK_K=128, BLOCK_V=128, BLOCK_R=128, R_CHUNK=32,
                  TILE_V=triton_module("_kda_decode_triton").LAUNCH["tile_v"], SPLITS=splits,
                  # as a launch at small's widths specialises: the integers that are multiples of 16 (not the
                  # projections' row stride, 6,284: 12 heads' beta in the fused projection), and the gate's
                  # columns, after beta's 12, off a 16-byte boundary
                  divisible=("s_state", "s_tq", "s_tk", "s_tv", "r_tq", "r_tk", "r_tv", "K", "V", "R"),
                  unaligned=("gate_ptr",))
    return sig, consts


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_compiles_for_the_h200(splits):
    """The kernel compiled for sm_90 by ptxas (no GPU needed), one program a head and 4 column splits: split, the
    ticket is an acquire-release atomic and the other programs' sums and outputs are read back from L2."""
    from sm90_compile import ptx_for_sm90

    sig, consts = _sm90_case(splits)
    ptx = ptx_for_sm90("k3.ops._kda_decode_triton", "kda_decode_kernel", sig,
                       num_warps=triton_module("_kda_decode_triton").LAUNCH["num_warps"], **consts)
    assert ("atom.global.gpu.acq_rel" in ptx and "ld.global.cg" in ptx) == (splits > 1)


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_does_not_spill_on_the_h200(splits):
    """ptxas's allocation for sm_90 at the launch (`LAUNCH`), its arguments specialised as a launch at small's
    widths specialises them: no spills. (Compiled without the integers' specialisation, as session 26 did, one
    program a head took 255 registers and spilled 152 B a thread; as launched it takes 168.)"""
    from sm90_compile import registers_for_sm90

    sig, consts = _sm90_case(splits)
    assert registers_for_sm90("k3.ops._kda_decode_triton", "kda_decode_kernel", sig,
                              num_warps=triton_module("_kda_decode_triton").LAUNCH["num_warps"], **consts)["STACK"] == 0
