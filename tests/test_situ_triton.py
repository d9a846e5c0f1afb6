"""The fused SiTU-GLU kernels (k3.ops._situ_triton) against the float64 reference, forward and backward, over
inputs from 1e-7 to 1e3 in magnitude: small arguments are where tanh written through a sigmoid cancels. On
CUDA where there is one, else on CPU under the Triton interpreter; skipped where triton is not installed."""
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernel_launches import record_launches  # noqa: E402

from k3.ops._math_triton import _exp_exact  # noqa: E402
from k3.ops.fused_situ import fused_situ_glu  # noqa: E402
from k3.ops.situ import situ_glu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def signed_magnitudes(n: int, g: torch.Generator) -> torch.Tensor:
    """n float64 values from 1e-7 to 1e3 in magnitude (log-uniform), either sign."""
    magnitude = 10.0 ** torch.empty(n, dtype=torch.float64).uniform_(-7, 3, generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double() * magnitude


def float64_glu(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[dict, dict]:
    """({h, dgate, dup} in float64, {the size of what each sums}) of float64 gate, up and upstream dh. The
    derivatives are written without cancellation (1 − tanh² = sech², 1 − σ(g) = σ(−g)): autograd through the
    formula rounds 1 − tanh² to 0 in float64 too once tanh is within 1e-16 of 1. Near a zero of ∂a/∂g its two terms
    cancel, in any precision: dgate's scale is the sum of their sizes."""
    ref = situ_glu(gate, up)
    a, b = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate), 25 * torch.tanh(up / 25)
    terms = (torch.cosh(gate / 4) ** -2 * torch.sigmoid(gate), 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) *
             torch.sigmoid(-gate))
    want = {"h": ref, "dgate": dh * b * (terms[0] + terms[1]), "dup": dh * a * torch.cosh(up / 25) ** -2}
    scale = {"h": ref.abs(), "dgate": (dh * b).abs() * (terms[0].abs() + terms[1].abs()), "dup": want["dup"].abs()}
    return want, scale


@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_kernels_match_float64_across_magnitudes(seed):
    g = torch.Generator().manual_seed(seed)
    n = 3000  # not a multiple of the block: a masked tail
    x = signed_magnitudes(n, g)
    gate, up = x[torch.randperm(n, generator=g)], x[torch.randperm(n, generator=g)]
    dh = torch.randn(n, generator=g, dtype=torch.float64)
    want, scale = float64_glu(gate, up, dh)
    g32, u32 = (t.detach().float().to(DEVICE).requires_grad_() for t in (gate, up))
    h = fused_situ_glu(g32, u32)
    gb, ub = torch.autograd.grad(h, (g32, u32), dh.float().to(DEVICE))
    # the plain path in fp32 (torch's tanh and sigmoid, autograd) sets the bar, element by element: within 2× its
    # error from float64, plus 2e-6 of the result's scale. So each output must hold fp32 accuracy on its own,
    # also where it is tiny (the bar is lower in the tails, where autograd through the formula loses everything)
    h_32 = situ_glu(g32.cpu(), u32.cpu())
    gr, ur = torch.autograd.grad(h_32, (g32, u32), dh.float())
    for name, got, bar in (("h", h, h_32), ("dgate", gb, gr), ("dup", ub, ur)):
        err = (got.double().cpu() - want[name]).abs()
        allowed = 2 * (bar.double().cpu() - want[name]).abs() + 2e-6 * scale[name] + 1e-36
        worst = (err / allowed).max()
        assert worst <= 1, f"{name}: {worst:.1f}x the allowed error"


@triton.jit
def exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _exp_exact(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_exp_holds_two_ulp_over_the_whole_fp32_range():
    """The kernels' exp (range reduction, exact 2^n from exponent bits) against float64, from where fp32's exp
    underflows past the smallest normal to where it overflows: tl.exp on a GPU loses |x| · 2^-24 relative."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.empty(4000).uniform_(-110, 95, generator=g), torch.tensor([0.0, -87.3, 88.7, 1e-30])])
    y = torch.empty_like(x, device=DEVICE)
    exp_kernel[(triton.cdiv(len(x), 1024),)](x.to(DEVICE), y, len(x), BLOCK=1024)
    want = torch.exp(x.double())
    normal = (want >= torch.finfo(torch.float32).tiny) & (want <= torch.finfo(torch.float32).max)
    ulp = torch.finfo(torch.float32).eps * want[normal]
    assert ((y.cpu().double()[normal] - want[normal]).abs() / ulp).max() <= 2
    assert (y.cpu()[want > torch.finfo(torch.float32).max] == float("inf")).all()
    assert (y.cpu()[want < 2.0 ** -150] == 0).all()  # past half the smallest subnormal: 0, not garbage bits
    assert ((y.cpu() >= 0) & (y.cpu() <= torch.finfo(torch.float32).tiny))[want < 2.0 ** -126].all()


def test_bf16_kernels_round_like_the_reference():
    """bf16 results take tl.exp (EXACT off): each element of h, dgate and dup within bf16 rounding of float64's."""
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(2, 777, generator=g, dtype=torch.float64) * 6, torch.randn(2, 777, generator=g,
                                                                                       dtype=torch.float64) * 40
    gate, up = gate.bfloat16().double(), up.bfloat16().double()  # the inputs the kernels see, exactly
    dh = torch.randn(2, 777, generator=g, dtype=torch.float64).bfloat16().double()
    gate.requires_grad_(), up.requires_grad_()
    ref = situ_glu(gate, up)
    want = (ref, *torch.autograd.grad(ref, (gate, up), dh))
    g16, u16 = (t.detach().bfloat16().to(DEVICE).requires_grad_() for t in (gate, up))
    h = fused_situ_glu(g16, u16)
    got = (h, *torch.autograd.grad(h, (g16, u16), dh.bfloat16().to(DEVICE)))
    for name, x, y in zip(("h", "dgate", "dup"), got, want):
        assert x.dtype == torch.bfloat16, name
        err = (x.double().cpu() - y.detach()).abs()
        assert (err <= 2 ** -7 * y.detach().abs() + 1e-6 * y.detach().abs().max()).all(), name


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_kernels_hold_each_element_across_magnitudes(seed):
    """16-bit results take the lean forms (e^−|x| through exp2, 1/(1 + e) through rsqrt², tanh's series below
    |x| = 1/8): across inputs from 1e-7 to 1e3 in magnitude, both signs (the tails, where σ and sech² are e^−|x|,
    and around tanh's series switch), h, dgate and dup each within bf16's rounding of float64's value of the same
    bf16 inputs (one unit in the last place: the GPU rounds to nearest, triton's interpreter truncates), plus
    fp32-level error of what each result sums (dgate's two terms cancel near a zero of ∂a/∂g), and an absolute
    1e-35 (values below fp32's normal range, flushed by the GPU's exp2)."""
    g = torch.Generator().manual_seed(10 + seed)
    switch = torch.tensor([0.125 * 4, 0.125 * 25]).repeat(50).double() * (1 + torch.linspace(-1e-2, 1e-2, 100))
    x = torch.cat([signed_magnitudes(5000, g), switch, -switch]).bfloat16().double()  # (exactly the kernels' inputs)
    gate, up = x[torch.randperm(len(x), generator=g)], x[torch.randperm(len(x), generator=g)]
    dh = torch.randn(len(x), generator=g, dtype=torch.float64).bfloat16().double()
    want, scale = float64_glu(gate, up, dh)
    g16, u16 = (t.bfloat16().to(DEVICE).requires_grad_() for t in (gate, up))
    h = fused_situ_glu(g16, u16)
    got = dict(zip(("h", "dgate", "dup"), (h, *torch.autograd.grad(h, (g16, u16), dh.bfloat16().to(DEVICE)))))
    for name in want:
        err = (got[name].double().cpu() - want[name]).abs()
        allowed = 2 ** -7 * want[name].abs() + 1e-5 * scale[name] + 1e-35
        worst = (err / allowed).max()
        i = (err / allowed).argmax()
        assert worst <= 1, (f"{name}: {worst:.2f}x the allowed error at gate {gate[i]}, up {up[i]}: "
                            f"{got[name][i]} for {want[name][i]}")


@pytest.mark.parametrize("shape, seed", [((3, 5), 0), ((2, 4, 7), 1), ((1, 1, 9), 2)])
def test_the_forward_reads_slices_of_a_fused_projection_in_place(shape, seed, monkeypatch):
    """Decode's shared experts hand gate and up as column slices of one fused projection's output ([..., z | gate |
    up], rows far apart). Without grad the kernel reads them at their row strides: no copy is made (the launch
    gets the slices' own storage) and h equals the fp32 reference on the same values, also for a view whose rows
    do not collapse into one stride (a transposed one, copied first)."""
    from k3.ops import _situ_triton

    g = torch.Generator().manual_seed(seed)
    *lead, I = shape
    wide = (torch.randn(*lead, 3 * I + 5, generator=g, dtype=torch.float64) * 3).float().to(DEVICE)
    gate, up = wide[..., 5:5 + I], wide[..., 5 + 2 * I:]  # z's 5 columns, then gate, a gap of I, up
    launches = record_launches(monkeypatch, _situ_triton, "situ_glu_fwd_kernel")
    with torch.no_grad():
        h = fused_situ_glu(gate, up)
        h_t = fused_situ_glu(gate.transpose(0, -1), up.transpose(0, -1)) if lead[0] > 1 else None
    # which storage and strides each launch was handed: (g rows, u rows, h, rows, cols, stride_g, stride_u, ...)
    launched = [(a[0].data_ptr(), a[1].data_ptr(), a[3], a[5], a[6]) for _, _, a, _ in launches]
    assert h.shape == gate.shape and h.is_contiguous()
    torch.testing.assert_close(h, situ_glu(gate, up), rtol=1e-5, atol=1e-6)
    rows = gate.numel() // I
    assert launched[0][:3] == (gate.data_ptr(), up.data_ptr(), rows)
    if rows > 1:  # (one row's stride is never used)
        assert launched[0][3:] == (wide.shape[-1], wide.shape[-1])
    if h_t is not None:
        torch.testing.assert_close(h_t, situ_glu(gate, up).transpose(0, -1), rtol=1e-5, atol=1e-6)
        assert launched[1][0] != gate.data_ptr()  # (copied: no view of a transpose has one row stride)


@pytest.mark.parametrize("dtype, lead, I, seed", [(torch.float32, (3, 5), 24, 0), (torch.float32, (1037,), 8, 1),
                                                  (torch.bfloat16, (2, 7), 40, 2), (torch.float32, (3, 700), 24, 3),
                                                  (torch.bfloat16, (5,), 1100, 4)])  # (two column tiles, one cut)
def test_the_joined_form_reads_gate_and_up_from_one_tensor_and_writes_the_gradient_joined(dtype, lead, I, seed,
                                                                                         monkeypatch):
    """`situ_glu_joined(gu)` of the routed experts' joined gate+up GEMM output (rows [gate | up]): h and the
    gradient equal the float64 reference of the two halves, and the gradient comes back as one [..., 2I] tensor in
    gu's layout, gate's half first (what one GEMM takes back to the input)."""
    from k3.ops import fused_situ
    from k3.ops.fused_situ import _FusedSiTUGLUJoined, situ_glu_joined

    monkeypatch.setattr(fused_situ, "fused_situ_available", lambda x: True)  # (the interpreter, on a CPU)
    g = torch.Generator().manual_seed(seed)
    gu64 = torch.randn(*lead, 2 * I, generator=g, dtype=torch.float64) * torch.tensor([4.0] * I + [30.0] * I)
    gu64 = gu64.to(dtype).double().requires_grad_()  # the values the kernels see, exactly
    dh = torch.randn(*lead, I, generator=g, dtype=torch.float64).to(dtype).double()
    ref = situ_glu(gu64[..., :I], gu64[..., I:])
    (dref,) = torch.autograd.grad(ref, gu64, dh)
    gu = gu64.detach().to(dtype).to(DEVICE).requires_grad_()
    h = situ_glu_joined(gu)
    assert isinstance(h.grad_fn, _FusedSiTUGLUJoined._backward_cls) and h.shape == (*lead, I)
    (dgu,) = torch.autograd.grad(h, gu, dh.to(dtype).to(DEVICE))
    assert dgu.shape == gu.shape and dgu.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(h.double().cpu(), ref.detach(), **tol)
    torch.testing.assert_close(dgu.double().cpu(), dref, **tol)
    with torch.no_grad():  # inference: the same forward kernel, no autograd node
        torch.testing.assert_close(situ_glu_joined(gu), h.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="even"):
        situ_glu_joined(gu[..., 1:])


# The training GLUs of `small` at 8 × 4096 tokens: the routed experts' joined form (top-8 of 512-wide experts), the
# shared experts' (1024 wide) and layer 0's dense MLP (6144), forward then backward, on meta tensors
SMALL_SITU_LAUNCH = """
import torch
from k3.ops import fused_situ as f
m = dict(device="meta", dtype=torch.bfloat16)
N = 8 * 4096
outs = [f._FusedSiTUGLUJoined.apply(torch.empty(8 * N, 2 * 512, **m).requires_grad_(), 4.0, 25.0)]
for I in (1024, 6144):
    outs.append(f.fused_situ_glu(*(torch.empty(N, I, **m).requires_grad_() for _ in range(2))))
for h in reversed(outs):
    h.backward(torch.empty(h.shape, **m))
"""


def test_the_precompile_table_holds_the_glus_launches_at_smalls_shape():
    """The shipped table's H200 specs of the SiTU-GLU kernels are what a training step of `small` launches (tiles,
    warps, argument types), each form once: a spec the step never launches costs a fresh machine's precompile
    workers a compile, and the step compiles its own in the main process. Re-record:
    tests/launch_spec_sm90.py's launch_specs(SMALL_SITU_LAUNCH), duplicates dropped, forwards in place of the
    table's forwards and backwards of its backwards."""
    from launch_spec_sm90 import launch_specs

    from k3.ops import tuning

    launched = []
    for spec in launch_specs(SMALL_SITU_LAUNCH):
        if spec not in launched:
            launched.append(spec)
    tiles = [(s["name"].rsplit(".", 1)[1], s["constant_vals"][:2]) for s in launched]
    assert tiles == [("situ_glu_fwd_kernel", [4, 512]), ("situ_glu_fwd_kernel", [2, 1024]),
                     ("situ_glu_bwd_kernel", [2, 1024]), ("situ_glu_bwd_kernel", [4, 512])]
    compiles = tuning.load_table(tuning.TABLE_PATH)["NVIDIA H200"]["compiles"]
    table = [s for s in compiles if s["name"].startswith("k3.ops._situ_triton.")]
    assert sorted(table, key=json.dumps) == sorted(launched, key=json.dumps)
