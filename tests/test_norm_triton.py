"""The Triton RMSNorm / L2-norm kernels (k3.ops._norm_triton) against autograd through the torch formulas:
outputs and gradients for several shapes, dtypes and weight kinds. On CUDA where there is one, else on CPU under
the Triton interpreter (slow: shapes stay small). Skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

import k3.ops.norm as norm_mod  # noqa: E402
from k3.ops import _norm_triton  # noqa: E402
from k3.ops.norm import rms_norm_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def inputs(seed, shape, x_dtype, w_dtype, noncontiguous=False):
    """x (mean 0.5, std 3), weight around 1 (or None) and an upstream gradient; x is a strided view when asked."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    if noncontiguous:  # [A, B, D] read from the middle columns of a transposed [B, A, D + 32] buffer
        base = torch.randn(shape[1], shape[0], D + 32, generator=g, dtype=torch.float64) * 3 + 0.5
        x = base.to(x_dtype).to(DEVICE).transpose(0, 1)[..., 16:16 + D]
        assert not x.is_contiguous() and x.shape == shape
    else:
        x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(x_dtype).to(DEVICE)
    w = None if w_dtype is None else \
        (1 + 0.4 * torch.randn(D, generator=g, dtype=torch.float64)).to(w_dtype).to(DEVICE)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(x_dtype).to(DEVICE)
    return x, w, dy


def run(fn, x, w, dy, need_x=True, need_w=True):
    """fn(x, w) and the gradients of ⟨fn(x, w), dy⟩ w.r.t. the inputs asked for (None for the others)."""
    xs = x.detach().requires_grad_(need_x)
    ws = None if w is None else w.detach().requires_grad_(need_w)
    y = fn(xs, ws)
    wanted = [t for t, n in ((xs, need_x), (ws, need_w and ws is not None)) if n]
    grads = iter(torch.autograd.grad(y, wanted, dy))
    return y, next(grads) if need_x else None, next(grads) if need_w and ws is not None else None


def assert_close(got, want, rtol):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * float(want.detach().abs().max()))


def tolerance(dtype):
    # the same fp32 math summed in another order: fp32 results agree to rounding, 16-bit ones to one ulp
    return 1e-5 if dtype == torch.float32 else 1e-2


SHAPES = [(3, 5, 128), (7, 1536), (2, 3, 4, 96), (300, 64), (3, 5000)]  # (300, 64): several tiles per program
DTYPES = [(torch.float32, torch.float32), (torch.float32, None), (torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16), (torch.bfloat16, None), (torch.float16, torch.float32)]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_rms_norm_output_and_gradients_match_the_formula(seed, shape, x_dtype, w_dtype):
    x, w, dy = inputs(100 + 10 * seed + DTYPES.index((x_dtype, w_dtype)), shape, x_dtype, w_dtype)
    y, gx, gw = run(lambda a, b: _norm_triton.rms_norm(a, b, EPS), x, w, dy)
    y_ref, gx_ref, gw_ref = run(lambda a, b: rms_norm_reference(a, b, EPS), x, w, dy)
    assert_close(y, y_ref, tolerance(x_dtype))
    assert_close(gx, gx_ref, tolerance(x_dtype))
    if w is None:
        assert gw is None
    else:  # summed in fp32 from the same 16-bit inputs: fp32 accuracy unless the weight itself is 16-bit
        assert_close(gw, gw_ref, tolerance(w_dtype))


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_rms_norm_of_a_noncontiguous_input(x_dtype, w_dtype):
    x, w, dy = inputs(7, (5, 3, 96), x_dtype, w_dtype, noncontiguous=True)
    y, gx, gw = run(lambda a, b: _norm_triton.rms_norm(a, b, EPS), x, w, dy)
    y_ref, gx_ref, gw_ref = run(lambda a, b: rms_norm_reference(a, b, EPS), x, w, dy)
    for got, want, dtype in ((y, y_ref, x_dtype), (gx, gx_ref, x_dtype), (gw, gw_ref, w_dtype)):
        assert_close(got, want, tolerance(dtype))


@pytest.mark.parametrize("need_x,need_w", [(True, False), (False, True)])
def test_rms_norm_computes_only_the_gradients_asked_for(need_x, need_w):
    x, w, dy = inputs(8, (300, 64), torch.float32, torch.float32)
    _, gx, gw = run(lambda a, b: _norm_triton.rms_norm(a, b, 1e-2), x, w, dy, need_x, need_w)
    _, gx_ref, gw_ref = run(lambda a, b: rms_norm_reference(a, b, 1e-2), x, w, dy, need_x, need_w)
    assert (gx is None) != need_x and (gw is None) != need_w
    for got, want in ((gx, gx_ref), (gw, gw_ref)):
        if want is not None:
            assert_close(got, want, 1e-5)


@pytest.mark.parametrize("tile,num_warps", [(64, 4), (256, 8), (8192, None)])
def test_backward_under_other_launch_shapes(monkeypatch, tile, num_warps):
    """The launch shapes (rows per tile, warps) are tunable for the GPU sweep: every shape gives the formula's
    output and gradients, with row counts that leave the last tile and the last program short."""
    for launch in (_norm_triton.FWD_LAUNCH, _norm_triton.BWD_LAUNCH):
        monkeypatch.setitem(launch, "tile", tile)
        monkeypatch.setitem(launch, "num_warps", num_warps)
    for seed, shape in ((12, (301, 64)), (13, (37, 96))):
        x, w, dy = inputs(seed, shape, torch.float32, torch.float32)
        y, gx, gw = run(lambda a, b: _norm_triton.rms_norm(a, b, EPS), x, w, dy)
        y_ref, gx_ref, gw_ref = run(lambda a, b: rms_norm_reference(a, b, EPS), x, w, dy)
        assert_close(y, y_ref, 1e-5)
        assert_close(gx, gx_ref, 1e-5)
        assert_close(gw, gw_ref, 1e-5)
    x, _, dy = inputs(14, (45, 3, 32), torch.float32, None)
    _, gx, _ = run(lambda a, _: _norm_triton.l2_norm(a, 1e-6), x, None, dy)
    _, gx_ref, _ = run(lambda a, _: l2_norm_formula(a, 1e-6), x, None, dy)
    assert_close(gx, gx_ref, 1e-5)


def l2_norm_formula(x, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed,shape", [(9, (2, 5, 3, 128)), (10, (6, 33))])
def test_l2_norm_output_and_gradient_match_the_formula(seed, shape, dtype):
    x, _, dy = inputs(seed, shape, dtype, None)
    y, gx, _ = run(lambda a, _: _norm_triton.l2_norm(a, 1e-6), x, None, dy)
    y_ref, gx_ref, _ = run(lambda a, _: l2_norm_formula(a, 1e-6), x, None, dy)
    assert_close(y, y_ref, tolerance(dtype))
    assert_close(gx, gx_ref, tolerance(dtype))


def test_norms_dispatch_to_the_kernels_where_use_triton_says_so(monkeypatch):
    """On CPU rms_norm/l2_norm keep the torch path; where use_triton holds they take the kernels, except for rows
    wider than MAX_D and weights that are not [D]."""
    x, w, _ = inputs(11, (4, 32), torch.float32, torch.float32)
    x.requires_grad_()
    fused = "_TritonNorm"
    if DEVICE == "cpu":
        assert fused not in type(norm_mod.rms_norm(x, w, EPS).grad_fn).__name__
        assert fused not in type(norm_mod.l2_norm(x).grad_fn).__name__
    monkeypatch.setattr(norm_mod, "use_triton", lambda t, name: name == "_norm_triton")
    y = norm_mod.rms_norm(x, w, EPS)
    assert fused in type(y.grad_fn).__name__ and torch.equal(y, _norm_triton.rms_norm(x, w, EPS))
    assert fused in type(norm_mod.l2_norm(x).grad_fn).__name__
    assert fused not in type(norm_mod.rms_norm(x, w[:1], EPS).grad_fn).__name__
    wide = torch.ones(1, _norm_triton.MAX_D + 1, device=DEVICE, requires_grad=True)
    assert fused not in type(norm_mod.rms_norm(wide, None, EPS).grad_fn).__name__
