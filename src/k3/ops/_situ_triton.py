"""Triton kernels for the fused SiTU-GLU (imported only on CUDA by k3.ops.fused_situ; needs triton).

One pass over gate and up: fp32 math in registers, one write of h (forward), of dgate and dup (backward),
instead of the reference's chain of fp32 temporaries.
"""
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: saturates cleanly at +-1 for large |x|
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def situ_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, beta_gate, beta_up, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = beta_gate * _tanh(g / beta_gate) * tl.sigmoid(g)
    b = beta_up * _tanh(u / beta_up)
    tl.store(h_ptr + offs, (a * b).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, beta_gate, beta_up, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t1 = _tanh(g / beta_gate)
    s = tl.sigmoid(g)
    t2 = _tanh(u / beta_up)
    a = beta_gate * t1 * s
    b = beta_up * t2
    da = (1.0 - t1 * t1) * s + beta_gate * t1 * s * (1.0 - s)
    db = 1.0 - t2 * t2
    tl.store(dg_ptr + offs, (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dh * a * db).to(du_ptr.dtype.element_ty), mask=mask)
