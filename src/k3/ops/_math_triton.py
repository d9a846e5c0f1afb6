"""Elementwise math for k3's Triton kernels (imported only by them; needs triton): exp, the reciprocal of 1 + e,
sigmoid, tanh and their pairs with σ(−x) and sech², each chosen by `EXACT`. EXACT (the GLU's and MLA's gate's fp32
results) takes an exp exact to ~2 ulp over fp32's range and IEEE division; otherwise the cheapest primitives that
keep ~1e-6 relative error, which kernels bound by instruction issue want: the GLU's and the gate's 16-bit results,
and the short conv's SiLU and the loss's exps at every dtype (where `tl.sigmoid` and `tl.exp`, no more exact, were).
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
