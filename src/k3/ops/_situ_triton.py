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


# 16-bit results (not EXACT) take the cheaper primitives: the kernels that form a GLU elementwise are bound by
# instruction issue, not by bytes (the H100 and the H200 took the same ~15 ms a `small` training step over them, at
# 3.35 and 4.8 TB/s), and bf16 rounds at 4e-3, far above what these lose (~1e-6 relative). On sm_90 `tl.exp2` is
# one MUFU.EX2 (results below 2^-126 flush to 0), where `tl.exp` adds the five instructions of a non-flushing
# ex2's range fix-ups; 1/x as rsqrt(x)² is MUFU.RSQ and a multiply, where `1 / x` compiles to ten with its range
# fix-ups, which the pairs' denominators 1 + e in [1, 2] never need.
@triton.jit
def _exp(x, EXACT: tl.constexpr):
    # EXACT (fp32 results) costs ~15 instructions more per exp
    if EXACT:
        return _exp_exact(x)
    else:
        return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _rcp_from_one(x, EXACT: tl.constexpr):
    # 1/x for x in [1, 2] (rsqrt squared: ~2^-22 relative)
    if EXACT:
        return 1.0 / x
    else:
        r = tl.math.rsqrt(x)
        return r * r


@triton.jit
def _tanh_series(x, EXACT: tl.constexpr):
    # below |x| = 1/8, where the forms through exp cancel (all digits lost at |x| ~ 1e-7 in fp32): the odd series to
    # x^9 (next term < 1e-9 · |x|), exact to fp32 rounding; to x^5 for 16-bit results (next term < 2.1e-7 · |x|)
    x2 = x * x
    if EXACT:
        return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    else:
        return x + (x * x2) * (-1.0 / 3.0 + x2 * (2.0 / 15.0))


@triton.jit
def _sigmoid(x, EXACT: tl.constexpr):
    return 1.0 / (1.0 + _exp(-x, EXACT))


@triton.jit
def _tanh(x, EXACT: tl.constexpr):
    return tl.where(tl.abs(x) < 0.125, _tanh_series(x, EXACT), 2.0 * _sigmoid(2.0 * x, EXACT) - 1.0)


@triton.jit
def _sigmoid_pair(x, EXACT: tl.constexpr):
    # σ(x) and σ(−x) = 1 − σ(x) from one exp of −|x| and one reciprocal: each keeps its relative precision in the
    # tail where it is e^−|x|, and 1 − σ never cancels
    e = _exp(-tl.abs(x), EXACT)
    d = _rcp_from_one(1.0 + e, EXACT)
    return tl.where(x >= 0, d, e * d), tl.where(x >= 0, e * d, d)


@triton.jit
def _tanh_sech2(x, EXACT: tl.constexpr):
    # tanh(x) and sech²(x) = 1 − tanh²(x) from one exp of −2|x| and one reciprocal. sech² as 4e/(1 + e)² keeps
    # its relative precision where 1 − tanh² rounds to 0
    e = _exp(-2.0 * tl.abs(x), EXACT)
    d = _rcp_from_one(1.0 + e, EXACT)
    tanh = tl.where(tl.abs(x) < 0.125, _tanh_series(x, EXACT), tl.where(x >= 0, 1.0 - e, e - 1.0) * d)
    return tanh, 4.0 * e * d * d


@triton.jit
def _situ_glu(g, u, beta_gate, beta_up, EXACT: tl.constexpr):
    """SiTU-GLU(g, u) in fp32 from fp32 g and u: β_g·tanh(g/β_g)·σ(g) · β_u·tanh(u/β_u) (k3.ops.situ). The one
    formula every kernel that forms a GLU calls (the elementwise forward, the GEMV's prologue, the experts' kernels,
    the expert-major combine's shared tail). EXACT takes one exp a function (with the exact exp, fewer instructions
    than the pairs; measured faster on the H200); 16-bit results the pairs' forms, whose cheap primitives need no
    range fix-up (35% fewer instructions than one exp a function with tl.exp and division)."""
    if EXACT:
        a = beta_gate * _tanh(g * (1.0 / beta_gate), EXACT) * _sigmoid(g, EXACT)
        return a * (beta_up * _tanh(u * (1.0 / beta_up), EXACT))
    else:
        s, _ = _sigmoid_pair(g, EXACT)
        t_g, _ = _tanh_sech2(g * (1.0 / beta_gate), EXACT)
        t_u, _ = _tanh_sech2(u * (1.0 / beta_up), EXACT)
        return (beta_gate * beta_up) * (t_g * s) * t_u


# The backward takes the pairs (3 exps, not 8). x/β is x · (1/β): one reciprocal per program, not per element (≤ 1 ulp
# on the argument). A program takes a [BLOCK_R, BLOCK_C] tile of rows at their own stride (gate and up may be column
# slices of a wider tensor: a fused projection's output, or the halves of the routed experts' joined gate+up GEMM),
# so no element's row is found by an integer division (the flat form's ~24 instructions an element) and the columns
# load as 16-byte vectors.
@triton.jit
def _tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(row indices as int64 [BLOCK_R, 1], column indices [1, BLOCK_C], the tile's mask)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return r.to(tl.int64)[:, None], c[None, :], (r < rows)[:, None] & (c < cols)[None, :]


@triton.jit
def situ_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, rows, cols, stride_g, stride_u, beta_gate, beta_up,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXACT: tl.constexpr):
    r, c, mask = _tile(rows, cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + r * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + r * cols + c, _situ_glu(g, u, beta_gate, beta_up, EXACT).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, rows, cols, row_stride, beta_gate, beta_up,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXACT: tl.constexpr):
    # gate and up (and dgate and dup, laid out alike) in rows `row_stride` apart: packed (row_stride = cols) or the
    # two halves of the routed experts' joined gate+up GEMM output and its gradient, which one GEMM then takes back
    # (k3.ops.grouped_mm); dh packed
    r, c, mask = _tile(rows, cols, BLOCK_R, BLOCK_C)
    at = r * row_stride + c
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
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
