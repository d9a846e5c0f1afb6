"""Triton kernels for the fused SiTU-GLU (imported only on CUDA by k3.ops.fused_situ; needs triton).

One pass over gate and up: fp32 math in registers, one write of h (forward), of dgate and dup (backward),
instead of the reference's chain of fp32 temporaries.
"""
import triton
import triton.language as tl


@triton.jit
def _exp(x):
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
def _sigmoid(x, EXACT: tl.constexpr):
    # EXACT (fp32 results) pays ~15 more instructions per exp, which makes the kernels compute-bound (2.7x slower
    # fwd+bwd on the H200); bf16 and fp16 results round away far more than tl.exp's error
    if EXACT:
        return 1.0 / (1.0 + _exp(-x))
    else:
        return tl.sigmoid(x)


@triton.jit
def _tanh(x, EXACT: tl.constexpr):
    # 2 sigmoid(2x) - 1 saturates cleanly at +-1 for large |x| but cancels near 0 (all digits lost at
    # |x| ~ 1e-7 in fp32); below |x| = 1/8 the odd series to x^9, whose next term is < 1e-9 · |x|, is exact
    # to fp32 rounding
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(x) < 0.125, series, 2.0 * _sigmoid(2.0 * x, EXACT) - 1.0)


@triton.jit
def _sech2(x, EXACT: tl.constexpr):
    return 4.0 * _sigmoid(2.0 * x, EXACT) * _sigmoid(-2.0 * x, EXACT)


@triton.jit
def situ_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, beta_gate, beta_up, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = beta_gate * _tanh(g / beta_gate, EXACT) * _sigmoid(g, EXACT)
    b = beta_up * _tanh(u / beta_up, EXACT)
    tl.store(h_ptr + offs, (a * b).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, beta_gate, beta_up, BLOCK: tl.constexpr,
                        EXACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t1 = _tanh(g / beta_gate, EXACT)
    s = _sigmoid(g, EXACT)
    t2 = _tanh(u / beta_up, EXACT)
    a = beta_gate * t1 * s
    b = beta_up * t2
    # 1 − tanh²(x) = 4 σ(2x) σ(−2x) and 1 − σ(g) = σ(−g): no cancellation where tanh and σ saturate, so the
    # derivatives keep their relative precision out in the tails (1 − t² and 1 − s round to 0 there)
    da = _sech2(g / beta_gate, EXACT) * s + beta_gate * t1 * s * _sigmoid(-g, EXACT)
    db = _sech2(u / beta_up, EXACT)
    tl.store(dg_ptr + offs, (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dh * a * db).to(du_ptr.dtype.element_ty), mask=mask)
