"""The Triton short conv (k3.ops._conv_triton) equals autograd through `short_conv_reference`: outputs, new tail
and the gradients of x, weight and tail, with and without tail and documents. Without CUDA the kernels run on CPU
under the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from k3.ops import _conv_triton  # noqa: E402
from k3.ops.conv import short_conv, short_conv_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the same sums of W products in another order; bf16: y and grad_x are that sum rounded to bf16 (an ulp apart)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def conv_case(seed, B, T, C, W, dtype, with_tail, with_doc):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    w = torch.randn(C, 1, W, generator=g)
    tail = torch.randn(B, W - 1, C, generator=g) if with_tail else None
    # random documents per row: sorted ids with gaps, so some documents are one token long
    doc = torch.randint(0, max(T // 3, 2), (B, T), generator=g).sort(-1).values if with_doc else None
    dy = torch.randn(B, T, C, generator=g).to(dtype)
    dtail = torch.randn(B, W - 1, C, generator=g)
    return tuple(None if t is None else t.to(DEVICE) for t in (x, w, tail, doc, dy, dtail))


def run(fn, x, w, tail, doc, dy, dtail, **kwargs):
    """fn's outputs and the gradients of ⟨y, dy⟩ (+ ⟨new_tail, dtail⟩ if dtail is given) for x, w (and tail)."""
    leaves = [t if t is None else t.detach().clone().requires_grad_() for t in (x, w, tail)]
    y, new_tail = fn(*leaves, doc, **kwargs)
    pairs = [(y, dy)] + ([(new_tail, dtail)] if dtail is not None else [])
    wanted = [t for t in leaves if t is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs])
    return (y, new_tail, *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_tail,with_doc", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("seed,B,T,C,W", [(1, 2, 37, 96, 4), (2, 1, 3, 64, 4), (3, 3, 64, 200, 4),
                                          (4, 2, 150, 40, 4), (5, 1, 1, 16, 4), (13, 1, 2, 64, 4), (6, 2, 9, 24, 2),
                                          (10, 2, 11, 24, 3), (11, 1, 5, 16, 1)])
def test_triton_short_conv_matches_the_reference(seed, B, T, C, W, dtype, with_tail, with_doc):
    x, w, tail, doc, dy, dtail = conv_case(seed, B, T, C, W, dtype, with_tail, with_doc)
    for grad_tail_out in (None, dtail):  # only y's gradient flows, then the new tail's too
        got = run(_conv_triton.short_conv, x, w, tail, doc, dy, grad_tail_out)
        want = run(short_conv_reference, x, w, tail, doc, dy, grad_tail_out)
        assert len(got) == len(want) == 4 + with_tail
        for name, a, b in zip(("y", "new_tail", "grad_x", "grad_weight", "grad_tail"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            tol = TOL[dtype] if name in ("y", "grad_x") else TOL[torch.float32]
            if name == "grad_weight":  # a sum over B·T products of x's dtype: scale the tolerance with it
                tol = dict(rtol=tol["rtol"], atol=tol["atol"] * (B * T) ** 0.5)
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_tail,with_doc", [(False, False), (True, True)])
@pytest.mark.parametrize("seed,B,T,C,W", [(21, 2, 37, 96, 4), (22, 3, 64, 200, 4), (23, 2, 9, 24, 2),
                                          (24, 1, 5, 16, 1), (25, 1, 150, 40, 3)])
def test_triton_short_conv_with_silu_matches_silu_after_the_reference(seed, B, T, C, W, dtype, with_tail, with_doc):
    """silu=True: SiLU of the conv in the kernels' passes equals F.silu after the reference conv, gradients too
    (dy through SiLU's derivative into x, the weight and the tail; the new tail's own gradient beside it).
    In bf16 the unfused path rounds the conv's output and dy · SiLU'(y) to bf16 between its ops and the kernels
    do not, so there both are held to float64 truth: the kernels' error may not exceed the unfused path's by
    more than the final rounding."""
    x, w, tail, doc, dy, dtail = conv_case(seed, B, T, C, W, dtype, with_tail, with_doc)
    x = x * 3  # conv outputs spread over SiLU's bend and both tails
    got = run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True)
    want = run(short_conv_reference, x, w, tail, doc, dy, dtail, silu=True)
    plain = run(short_conv_reference, x, w, tail, doc, dy, dtail)
    assert not torch.allclose(want[0].float(), plain[0].float())  # the SiLU did change y
    as64 = lambda t: None if t is None else t.double()  # noqa: E731
    truth = run(short_conv_reference, *map(as64, (x, w, tail)), doc, *map(as64, (dy, dtail)), silu=True)
    for name, a, b, t in zip(("y", "new_tail", "grad_x", "grad_weight", "grad_tail"), got, want, truth):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if dtype == torch.bfloat16 and t.numel():  # (a 1-tap conv's tail is empty)
            err, err_unfused = ((v.double() - t).abs().max().item() for v in (a, b))
            # bf16 outputs may be an ulp off beside that: their final rounding (the interpreter truncates)
            ulp = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-6
            assert err <= 1.25 * err_unfused + ulp * t.abs().max().item(), (name, err, err_unfused)
            continue
        tol = TOL[torch.float32]
        if name == "grad_weight":  # a sum over B·T products: scale the tolerance with it
            tol = dict(rtol=tol["rtol"], atol=tol["atol"] * 3 * (B * T) ** 0.5)
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("W", [4, 3])
@pytest.mark.parametrize("chunk,unroll,block_c", [(8, 3, 16), (5, 4, 32), (7, 2, 16), (6, 1, 32)])
def test_backward_at_short_chunks_and_any_unroll_matches_float64(monkeypatch, chunk, unroll, block_c, W):
    """The rows backward with chunks of 5 to 8 rows (every chunk's ends meet documents, the tail and the new
    tail's rows; UNROLL 1 to 4, dividing a chunk's steps or not; channel blocks past C): x, weight and tail
    gradients of fp32 inputs against the float64 reference (SiLU on, both outputs' gradients). On CUDA this is
    also the check of the compiled row loop (UNROLL 2 lost a window slot there: test_rows_backward_compiles_...)."""
    monkeypatch.setattr(_conv_triton, "BWD_CHUNK_T", chunk)
    monkeypatch.setattr(_conv_triton, "BWD_UNROLL", unroll)
    monkeypatch.setattr(_conv_triton, "BWD_BLOCK_C", block_c)
    x, w, tail, doc, dy, dtail = conv_case(31 + W + unroll, 2, 37, 40, W, torch.float32, True, True)
    got = run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True)
    as64 = lambda t: t.double()  # noqa: E731
    want = run(short_conv_reference, *map(as64, (x, w, tail)), doc, *map(as64, (dy, dtail)), silu=True)
    for name, a, b in zip(("y", "new_tail", "grad_x", "grad_weight", "grad_tail"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (74 ** 0.5 if name == "grad_weight" else 1),
                                   msg=lambda m: f"{name}: {m}")


# the backward kernel's argument types and every option on, for the sm_90 compiles
BWD_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "tail_ptr": "*bf16", "doc_ptr": "*i64", "gy_ptr": "*bf16",
                 "gnt_ptr": "*bf16", "gx_ptr": "*bf16", "gw_part_ptr": "*fp32",
                 "gw_batch_ptr": "*fp32", "gw_ptr": "*bf16", "count_ptr": "*i32", "gtail_ptr": "*bf16", "C": "i32"}
BWD_FLAGS = dict(W=4, HAS_TAIL=True, HAS_DOC=True, SILU=True, HAS_GY=True, HAS_GNT=True, NEED_GX=True, NEED_GW=True,
                 NEED_GTAIL=True, CHUNK_T=64, BLOCK_C=128, FINISH_ROWS=_conv_triton.GW_FINISH_ROWS)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("unroll", sorted({2, _conv_triton.BWD_UNROLL}))
def test_rows_backward_compiles_for_sm90_with_t_1_and_carries_its_windows(unroll, stages):
    """Compiled for the H200 (no GPU: tests/sm90_compile.py) with T == 1 specialised, as Triton does for a launch
    at T = 1 (T was then a plain int: `T.to(...)` failed there), every option on: the row loop carries what the
    next step reads, the last MAX_TAPS − 1 rows of x, of dz and of the document ids, and the W tap sums (13
    values). Triton carries a name only where the body leaves it another value than it found: with slots sharing
    one starting zero, UNROLL 2 carried 2 rows of x and dz, not 3 (the H200 gave rel_err 0.35); the interpreter
    carries every name, so only the compiled loop shows it."""
    import re

    from sm90_compile import asm_for_sm90

    ttir = asm_for_sm90("ttir", "k3.ops._conv_triton", "short_conv_bwd_kernel", BWD_SIGNATURE, num_warps=1, T=1,
                        **BWD_FLAGS, UNROLL=unroll, STAGES=stages, FINISH_GW=True, CHANNELS_FIRST=False)
    loops = re.findall(r"scf\.for .*? iter_args\((.*?)\) ->", ttir)  # (the weight gradient's finish: scf.while)
    assert len(loops) == 1, ttir[-3000:]
    carried = loops[0].split(", ")  # "%name = %init" each
    assert len(carried) == 3 * (_conv_triton.MAX_TAPS - 1) + 4, loops[0]


@pytest.mark.parametrize("finish", [True, False])
@pytest.mark.parametrize("channels_first", [False, True])
@pytest.mark.parametrize("seed,B,T,C", [(51, 3, 1, 24), (52, 1, 67, 40), (53, 5, 19, 16), (54, 2, 40, 33)])
def test_weight_gradient_finish_and_grid_order_match_float64(monkeypatch, seed, B, T, C, finish, channels_first):
    """The weight gradient summed by the backward kernel itself (BWD_FINISH_GW: per batch, then over the
    batches, by the last program to arrive) or by torch after it, with the chunks or the channel blocks on grid
    axis 0 (BWD_CHANNELS_FIRST), at T == 1, odd T, one to five batch rows, several chunks and channel blocks
    (chunks of 8 rows, 16 channels; the finish loads 2 partials at a time, so its loops run more than once):
    x, weight and tail gradients against the float64 reference."""
    monkeypatch.setattr(_conv_triton, "BWD_FINISH_GW", finish)
    monkeypatch.setattr(_conv_triton, "BWD_CHANNELS_FIRST", channels_first)
    monkeypatch.setattr(_conv_triton, "BWD_CHUNK_T", 8)
    monkeypatch.setattr(_conv_triton, "BWD_BLOCK_C", 16)
    monkeypatch.setattr(_conv_triton, "GW_FINISH_ROWS", 2)
    x, w, tail, doc, dy, dtail = conv_case(seed, B, T, C, 4, torch.float32, True, True)
    got = run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True)
    as64 = lambda t: t.double()  # noqa: E731
    want = run(short_conv_reference, *map(as64, (x, w, tail)), doc, *map(as64, (dy, dtail)), silu=True)
    for name, a, b in zip(("y", "new_tail", "grad_x", "grad_weight", "grad_tail"), got, want):
        assert a.dtype == (torch.float32 if name != "grad_weight" else w.dtype) and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (B * T) ** 0.5 if name == "grad_weight"
                                   else 1e-5, msg=lambda m: f"{name}: {m}")


def test_weight_gradient_finished_in_the_kernel_does_not_depend_on_which_program_arrives_last(monkeypatch):
    """The kernel's finish sums the partials in chunk then batch order, whichever program arrives last: the
    two grid orders (the interpreter runs programs one at a time in grid order, so another program is the last
    of each batch and channel block) give the same bits, in the weight's own dtype (bf16 here: the cast is the
    kernel's too)."""
    monkeypatch.setattr(_conv_triton, "BWD_FINISH_GW", True)
    monkeypatch.setattr(_conv_triton, "BWD_CHUNK_T", 8)
    monkeypatch.setattr(_conv_triton, "BWD_BLOCK_C", 16)
    x, w, tail, doc, dy, dtail = conv_case(55, 3, 29, 40, 4, torch.bfloat16, True, True)
    w = w.to(torch.bfloat16)
    grads = []
    for channels_first in (False, True):
        monkeypatch.setattr(_conv_triton, "BWD_CHANNELS_FIRST", channels_first)
        grads.append(run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True)[3])
    assert grads[0].dtype == torch.bfloat16 and torch.equal(grads[0], grads[1])
    monkeypatch.setattr(_conv_triton, "BWD_FINISH_GW", False)  # the torch sum: another order, same value
    torch.testing.assert_close(grads[0], run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True)[3],
                               rtol=1e-2, atol=1e-2)


def test_weight_gradient_finish_publishes_its_partials_for_sm90():
    """Compiled for the H200 (tests/sm90_compile.py), the finish's memory ordering: each ticket is an
    acquire-release atomic at GPU scope taken after a barrier (every thread's partials stored before it is
    released), and the partials other programs wrote are loaded past L1 (.cg: L1 is not coherent). The
    interpreter runs one program at a time, so only the compiled code can show this; in both grid orders."""
    import re

    from sm90_compile import ptx_for_sm90

    for channels_first in (False, True):
        ptx = ptx_for_sm90("k3.ops._conv_triton", "short_conv_bwd_kernel", {**BWD_SIGNATURE, "T": "i32"},
                           num_warps=1, **BWD_FLAGS,
                           UNROLL=_conv_triton.BWD_UNROLL, STAGES=_conv_triton.BWD_STAGES, FINISH_GW=True,
                           CHANNELS_FIRST=channels_first)
        code = [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith(("//", "."))]
        tickets = [i for i, line in enumerate(code) if re.search(r"\batom\.", line)]
        assert len(tickets) == 2, tickets  # one per level: the batch's chunks, then the batches
        for i in tickets:
            assert "acq_rel" in code[i] and ".gpu" in code[i], code[i]
            stores = [j for j in range(i) if "st.global" in code[j]]
            barriers = [j for j in range(i) if code[j].startswith("bar.sync")]
            assert barriers and barriers[-1] > stores[-1], code[stores[-1]:i + 1]  # the last store, then a barrier
        after = "\n".join(code[tickets[0]:])
        assert re.search(r"ld\.global\.cg", after) and not re.search(r"ld\.global(\.v\d)?\.(b|f)32", after), \
            "partials loaded through L1"


def test_widths_past_max_taps_take_the_torch_path(monkeypatch):
    """The kernels keep one accumulator per tap up to MAX_TAPS: a wider conv dispatches to the torch path
    (same results), a width within it to the kernels."""
    import k3.ops.conv as conv_mod

    calls = []
    real = _conv_triton.short_conv
    monkeypatch.setattr(_conv_triton, "short_conv", lambda *a: calls.append(a[1].shape[-1]) or real(*a))
    monkeypatch.setattr(conv_mod, "use_triton", lambda t, name: name == "_conv_triton")
    W = _conv_triton.MAX_TAPS + 1
    x, w, tail, doc, dy, dtail = conv_case(26, 1, 12, 16, W, torch.float32, True, True)
    got = run(short_conv, x, w, tail, doc, dy, dtail, silu=True)
    want = run(short_conv_reference, x, w, tail, doc, dy, dtail, silu=True)
    assert calls == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    with pytest.raises(ValueError, match="MAX_TAPS"):
        real(x, w, tail, doc)
    x, w, tail, doc, dy, dtail = conv_case(27, 1, 12, 16, W - 1, torch.float32, True, True)
    run(short_conv, x, w, tail, doc, dy, dtail, silu=True)
    assert calls == [W - 1]


@pytest.mark.parametrize("with_tail,with_doc", [(False, False), (True, True)])
def test_int64_offsets_give_the_same_result(monkeypatch, with_tail, with_doc):
    """Rows with T · C >= 2^31 index in int64 (the int32 offsets would wrap past 2 GiB elements); that path,
    forced on a small shape, equals the reference like the int32 one."""
    monkeypatch.setattr(_conv_triton, "_WIDE_FROM", 0)
    assert _conv_triton._wide(3, 16)
    x, w, tail, doc, dy, dtail = conv_case(7, 2, 45, 48, 4, torch.float32, with_tail, with_doc)
    for a, b in zip(run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail),
                    run(short_conv_reference, x, w, tail, doc, dy, dtail)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_double_backward_is_refused():
    """The kernels' gradients are not differentiable: a second derivative through them must fail loudly, not
    count the conv's part as a constant (here the x² term alone would make the call succeed)."""
    x, w, *_ = conv_case(8, 1, 9, 16, 4, torch.float32, False, False)
    x = x.detach().requires_grad_()
    y, _ = _conv_triton.short_conv(x, w, None, None)
    (gx,) = torch.autograd.grad((y * y).sum() + (x * x).sum(), x, create_graph=True)  # ∂L/∂y = 2y needs grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_document_id_minus_one_reads_the_tail_like_the_reference():
    """The reference pads document ids with −1 on the left, so a row starting in document −1 sees the tail."""
    x, w, tail, doc, dy, dtail = conv_case(12, 2, 10, 32, 4, torch.float32, True, True)
    doc = doc - doc[:, :1] - 1  # each row's first document is −1
    got = run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail)
    want = run(short_conv_reference, x, w, tail, doc, dy, dtail)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert got[4].abs().min() > 0  # T > W-1: the tail's gradient comes through y's taps, so they did read it


def test_only_the_new_tails_gradient_and_a_non_contiguous_input():
    """grad of y None (only the new tail used): x gets the new tail's gradient in its last rows, the weight none."""
    x, w, tail, _, _, dtail = conv_case(7, 2, 5, 48, 4, torch.float32, True, False)
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # [B, T, C] view with B and T strides swapped
    assert not x.is_contiguous()
    results = []
    for fn in (_conv_triton.short_conv, short_conv_reference):
        xs, ws, ts = (t.detach().clone().requires_grad_() for t in (x, w, tail))
        y, new_tail = fn(xs, ws, ts, None)
        new_tail.backward(dtail)
        results.append((y, new_tail, xs.grad, ts.grad, ws.grad))
    (y, nt, gx, gt, gw), (y_ref, nt_ref, gx_ref, gt_ref, gw_ref) = results
    for a, b in ((y, y_ref), (nt, nt_ref), (gx, gx_ref), (gt, gt_ref)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert gw is None and gw_ref is None
    assert torch.equal(gx[:, :2], torch.zeros_like(gx[:, :2])) and torch.equal(gx[:, 2:], dtail)


def test_new_tail_is_a_fresh_fp32_tensor_and_grads_skip_inputs_that_need_none():
    x, w, tail, doc, dy, _ = conv_case(8, 2, 12, 32, 4, torch.bfloat16, True, True)
    y, new_tail = _conv_triton.short_conv(x, w.requires_grad_(), tail, doc)
    assert new_tail.dtype == torch.float32 and new_tail.untyped_storage().nbytes() == new_tail.nbytes
    (gw,) = torch.autograd.grad(y, w, dy)  # x and tail need no gradient: the kernel writes only the weight's
    (gw_ref,) = torch.autograd.grad(short_conv_reference(x, w, tail, doc)[0], w, dy)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch takes the kernels on CUDA only")
def test_short_conv_dispatches_to_triton_on_cuda(monkeypatch):
    from k3 import envs

    calls = []
    real = _conv_triton.short_conv
    monkeypatch.setattr(_conv_triton, "short_conv", lambda *a: calls.append(1) or real(*a))
    x, w, tail, doc, _, _ = conv_case(9, 2, 20, 64, 4, torch.bfloat16, True, True)
    with envs.override(no_triton=frozenset(), triton_opt_in=frozenset()):  # on by default
        y, new_tail = short_conv(x, w, tail, doc)
    y_ref, new_tail_ref = short_conv_reference(x, w, tail, doc)
    assert calls and torch.equal(new_tail, new_tail_ref)
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])


def test_backward_is_bitwise_reproducible():
    """The weight gradient is a sum over every row (per-chunk partials, then their sum in a fixed order, no
    atomics): two backwards of the same inputs give the same bits, x's and the tail's gradients too."""
    x, w, tail, doc, dy, dtail = conv_case(41, 2, 70, 40, 4, torch.bfloat16, True, True)  # two chunks of rows
    first, second = (run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---- l2_head: each head's L2 norm after the SiLU (KDA's q and k in training) ------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_tail,with_doc", [(False, False), (True, True)])
@pytest.mark.parametrize("seed,B,T,C,W,K,block_c", [(61, 2, 37, 96, 4, 32, None), (62, 1, 70, 64, 4, 16, None),
                                                    (63, 3, 9, 128, 3, 64, 64), (64, 1, 5, 48, 4, 16, 32)])
def test_l2_heads_match_the_reference_against_float64(monkeypatch, seed, B, T, C, W, K, block_c, dtype, with_tail,
                                                      with_doc):
    """silu=True, l2_head=K: y = l2(SiLU(conv)) per head of K channels, and the gradients through the norm, the
    SiLU and the conv into x, the weight and the tail (the new tail's own gradient beside), against the
    reference's float64 autograd: fp32 to 1e-5; bf16 no further from float64 than the unfused reference path in
    bf16 (which rounds between its ops) plus the final rounding. Heads of 16 to 64 channels; channel tiles
    past C (96 channels in a 128-wide forward tile, 48 in 32-wide backward tiles: a head cut by the mask would
    be normalised wrongly), several backward tiles (block_c 32, 64: two and one heads a tile), chunks of 8 rows."""
    if block_c is not None:
        monkeypatch.setattr(_conv_triton, "BWD_BLOCK_C", block_c)
    monkeypatch.setattr(_conv_triton, "BWD_CHUNK_T", 8)
    x, w, tail, doc, dy, dtail = conv_case(seed, B, T, C, W, dtype, with_tail, with_doc)
    x = x * 3
    got = run(_conv_triton.short_conv, x, w, tail, doc, dy, dtail, silu=True, l2_head=K)
    want = run(short_conv_reference, x, w, tail, doc, dy, dtail, silu=True, l2_head=K)
    as64 = lambda t: None if t is None else t.double()  # noqa: E731
    truth = run(short_conv_reference, *map(as64, (x, w, tail)), doc, *map(as64, (dy, dtail)), silu=True,
                l2_head=K)
    norms = truth[0].unflatten(-1, (-1, K)).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-5)  # the reference does normalise
    for name, a, b, t in zip(("y", "new_tail", "grad_x", "grad_weight", "grad_tail"), got, want, truth):
        assert a.shape == t.shape and a.dtype == b.dtype, name
        if dtype == torch.bfloat16 and t.numel():
            err, err_unfused = ((v.double() - t).abs().max().item() for v in (a, b))
            ulp = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-6
            assert err <= 1.25 * err_unfused + ulp * t.abs().max().item(), (name, err, err_unfused)
            continue
        atol = 1e-5 * ((B * T) ** 0.5 if name == "grad_weight" else 1)
        torch.testing.assert_close(a.double(), t, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def test_l2_heads_dispatch_and_refusals(monkeypatch):
    """k3.ops.conv.short_conv with l2_head: the kernels take heads that tile their passes (one launch, the norm
    inside), other widths the kernels' conv then the separate norm (same values); l2_head without the SiLU, or
    a width that does not divide the channels, is refused on every path."""
    import k3.ops.conv as conv_mod

    calls = []
    real = _conv_triton.short_conv
    monkeypatch.setattr(_conv_triton, "short_conv", lambda *a: calls.append(a[4:]) or real(*a))
    monkeypatch.setattr(conv_mod, "use_triton", lambda t, name: name == "_conv_triton")
    for K, fused in ((16, True), (24, False)):
        x, w, tail, doc, dy, dtail = conv_case(70 + K, 2, 11, 48, 4, torch.float32, True, True)
        calls.clear()
        got = run(short_conv, x, w, tail, doc, dy, dtail, silu=True, l2_head=K)
        want = run(short_conv_reference, x, w, tail, doc, dy, dtail, silu=True, l2_head=K)
        assert calls == [(True, K) if fused else (True,)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    x, w, *_ = conv_case(80, 1, 4, 48, 4, torch.float32, False, False)
    for kwargs in (dict(silu=False, l2_head=16), dict(silu=True, l2_head=32), dict(silu=True, l2_head=0)):
        with pytest.raises(ValueError, match="l2_head"):
            short_conv(x, w, **kwargs)
    with pytest.raises(ValueError, match="l2_head"):
        real(x, w, None, None, True, 24)  # the kernels' own check: a width that does not tile them


# a training KDA layer's three short convs at small's shape (8 x 4096, 1536 channels, bf16 weights as the bench's;
# no documents, as the shipped table was recorded): q and k with their heads' norm, then v; backward in reverse
SMALL_CONV_LAUNCH = """
import torch
from k3.ops import _conv_triton as c
B, T, C = 8, 4096, 1536
m = dict(device="meta", dtype=torch.bfloat16)
w = torch.empty(C, 1, 4, **m).requires_grad_()
ys = []
for l2 in (128, 128, None):
    x = torch.empty(B, T, C, **m).requires_grad_()
    ys.append(c.short_conv(x, w, None, None, True, l2)[0])
for y in reversed(ys):
    y.backward(torch.empty(B, T, C, **m))
"""


def test_the_precompile_table_holds_the_convs_launches_at_smalls_shape():
    """The shipped table's H200 specs of the conv kernels are what a training KDA layer launches (constants,
    warps, argument types), each form once, forward then backward: a launch constant changed without them makes a
    fresh machine's precompile workers compile a kernel the step never runs, and the step compile its own in the
    main process (the backward's FINISH_ROWS had drifted so, found in session 42). Re-record:
    tests/launch_spec_sm90.py's launch_specs(SMALL_CONV_LAUNCH), duplicates dropped, in place of the table's."""
    from launch_spec_sm90 import launch_specs

    from k3.ops import tuning

    launched = []
    for spec in launch_specs(SMALL_CONV_LAUNCH):
        if spec not in launched:
            launched.append(spec)
    assert [s["name"].rsplit(".", 1)[1] for s in launched] == ["short_conv_fwd_kernel"] * 2 + [
        "short_conv_bwd_kernel"] * 2
    compiles = tuning.load_table(tuning.TABLE_PATH)["NVIDIA H200"]["compiles"]
    assert [s for s in compiles if s["name"].startswith("k3.ops._conv_triton.")] == launched
