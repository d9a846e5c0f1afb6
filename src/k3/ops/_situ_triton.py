"""Triton kernels for the fused SiTU-GLU (imported only on CUDA by k3.ops.fused_situ; needs triton).

One pass over gate and up: fp32 math in registers, one write of h (forward), of dgate and dup (backward),
instead of the reference's chain of fp32 temporaries.
"""
import triton
import triton.language as tl

from k3.ops._math_triton import _sigmoid, _sigmoid_pair, _tanh, _tanh_sech2


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
