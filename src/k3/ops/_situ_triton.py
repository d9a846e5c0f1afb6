"""Triton kernels for the fused SiTU-GLU (imported only on CUDA by k3.ops.fused_situ; needs triton).

One pass over gate and up: fp32 math in registers, one write of h (forward), of dgate and dup (backward),
instead of the reference's chain of fp32 temporaries.
"""
import triton
import triton.language as tl


@triton.jit
def _exp_exact(x):
    # exp to ~2 ulp over fp32's whole range. tl.exp on a GPU is ex2.approx(x · log2 e), and rounding that product
    # costs |x| · 2^-24 relative: 3e-6 at |x| = 40, where σ(−40) still matters. Here only a reduced
    # r = x − n ln 2, |r| <= 0.35 (ln 2 split in two, so n ln 2 is exact), goes through tl.exp; 2^n is exact
    # exponent bits, in two factors so that each stays a normal float
    x = tl.minimum(tl.maximum(x, -104.0), 89.0)  # exp is 0 and inf in fp32 beyond
    n = tl.floor(x * 1.4426950408889634 + 0.5)
    r = (x - n * 0.693145751953125) - n * 1.4286068203094173e-06
    n = n.to(tl.int32)
    half = n >> 1
    two_half = ((half + 127) << 23).to(tl.float32, bitcast=True)
    two_rest = ((n - half + 127) << 23).to(tl.float32, bitcast=True)
    return tl.exp(r) * two_half * two_rest


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    # EXACT (fp32 results) costs ~15 instructions more per exp; bf16 and fp16 results round away far more than
    # tl.exp's error (below 2^-9 relative for |x| < 2^15)
    if EXACT:
        return _exp_exact(x)
    else:
        return tl.exp(x)


@triton.jit
def _tanh_series(x):
    # below |x| = 1/8 the odd series to x^9, whose next term is < 1e-9 · |x|, is exact to fp32 rounding; the
    # forms through exp cancel near 0 (all digits lost at |x| ~ 1e-7 in fp32)
    x2 = x * x
    return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))


@triton.jit
def _sigmoid(x, EXACT: tl.constexpr):
    return 1.0 / (1.0 + _exp(-x, EXACT))


@triton.jit
def _tanh(x, EXACT: tl.constexpr):
    return tl.where(tl.abs(x) < 0.125, _tanh_series(x), 2.0 * _sigmoid(2.0 * x, EXACT) - 1.0)


@triton.jit
def _situ_glu(g, u, beta_gate, beta_up, EXACT: tl.constexpr):
    """SiTU-GLU(g, u) in fp32 from fp32 g and u: β_g·tanh(g/β_g)·σ(g) · β_u·tanh(u/β_u) (k3.ops.situ). The one
    formula every kernel that forms a GLU calls (the elementwise forward, the GEMV's prologue, the experts' kernels,
    the expert-major combine's shared tail)."""
    a = beta_gate * _tanh(g * (1.0 / beta_gate), EXACT) * _sigmoid(g, EXACT)
    return a * (beta_up * _tanh(u * (1.0 / beta_up), EXACT))


@triton.jit
def _sigmoid_pair(x, EXACT: tl.constexpr):
    # σ(x) and σ(−x) = 1 − σ(x) from one exp of −|x| and one division: each keeps its relative precision in the
    # tail where it is e^−|x|, and 1 − σ never cancels
    e = _exp(-tl.abs(x), EXACT)
    d = 1.0 / (1.0 + e)
    return tl.where(x >= 0, d, e * d), tl.where(x >= 0, e * d, d)


@triton.jit
def _tanh_sech2(x, EXACT: tl.constexpr):
    # tanh(x) and sech²(x) = 1 − tanh²(x) from one exp of −2|x| and one division. sech² as 4e/(1 + e)² keeps
    # its relative precision where 1 − tanh² rounds to 0
    e = _exp(-2.0 * tl.abs(x), EXACT)
    d = 1.0 / (1.0 + e)
    tanh = tl.where(tl.abs(x) < 0.125, _tanh_series(x), tl.where(x >= 0, 1.0, -1.0) * ((1.0 - e) * d))
    return tanh, 4.0 * e * d * d


# The forward takes one exp per function (fewer instructions than the pairs, measured faster on the H200); the
# backward takes the pairs (3 exps, not 8). Both are bound by the special-function unit (exp, reciprocal), so
# x/β is x · (1/β): one reciprocal per program, not per element (≤ 1 ulp on the argument)
@triton.jit
def _row_offsets(start, cols, row_stride, BLOCK: tl.constexpr, STRIDED: tl.constexpr):
    # elements start .. start + BLOCK of a [rows, cols] tensor at their place in rows `row_stride` apart (a column
    # slice of a wider one: gate and up of a fused projection's output); packed rows: start + i. The row split is
    # one int64 division a program and int32 ones per element (int64 division is a long emulated sequence, and
    # the routed experts' training GLU runs this on every element)
    if STRIDED:
        row0 = start // cols
        local = (start - row0 * cols).to(tl.int32) + tl.arange(0, BLOCK)
        r = local // cols
        return (row0 + r) * row_stride + (local - r * cols)
    return start + tl.arange(0, BLOCK)


@triton.jit
def situ_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, cols, stride_g, stride_u, beta_gate, beta_up, BLOCK: tl.constexpr,
                        EXACT: tl.constexpr, STRIDED: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + _row_offsets(start, cols, stride_g, BLOCK, STRIDED), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + _row_offsets(start, cols, stride_u, BLOCK, STRIDED), mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, _situ_glu(g, u, beta_gate, beta_up, EXACT).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, cols, row_stride, beta_gate, beta_up,
                        BLOCK: tl.constexpr, EXACT: tl.constexpr, STRIDED: tl.constexpr):
    # STRIDED: gate and up (and dgate and dup, laid out alike) as the two halves of rows `row_stride` apart: the
    # routed experts' joined gate+up GEMM output and its gradient, which one GEMM then takes back (k3.ops.grouped_mm)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    at = _row_offsets(start, cols, row_stride, BLOCK, STRIDED)
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t1, sech2_g = _tanh_sech2(g * (1.0 / beta_gate), EXACT)
    s, s_neg = _sigmoid_pair(g, EXACT)
    t2, db = _tanh_sech2(u * (1.0 / beta_up), EXACT)
    a = beta_gate * t1 * s
    b = beta_up * t2
    # sech² and σ(−g) rather than 1 − t² and 1 − s: the derivatives keep their relative precision out in the
    # tails, where those differences round to 0
    da = sech2_g * s + beta_gate * t1 * s * s_neg
    tl.store(dg_ptr + at, (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + at, (dh * a * db).to(du_ptr.dtype.element_ty), mask=mask)
