"""Triton kernels for RMSNorm and L2 normalisation over the last dim (imported only through
k3.ops.triton_dispatch; needs triton). Same contract as `k3.ops.norm.rms_norm` / `l2_norm` for bf16/fp16/fp32.

One read of x and one write of y forward; one read of x and dy and one write of dx backward, all math in fp32
registers. Backward keeps only x and the fp32 per-row rstd. Both norms are `x · rsqrt(Σx² / div + eps)`
(div = D for RMSNorm, 1 for L2), so they share the kernels:
  dx = rstd · (g⊙w − x̂ · Σ(g⊙w⊙x̂) / div),  dw = Σ_rows g ⊙ x̂.
"""
import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from k3.ops.triton_dispatch import on_device, sm_count

MAX_D = 8192  # one row must fit in one program's registers (8 per thread at 32 warps); wider: the torch path
_TILE = 4096  # elements per program tile: rows are batched up to this when D is small


@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, div, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / div + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, D, div,
                     tiles_per_program, n_tiles,
                     HAS_WEIGHT: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each program walks `tiles_per_program` consecutive row tiles (fewer in the last program) in one pass and
    writes its fp32 partial Σ g⊙x̂ to row `program_id` of dw_partial [num_programs, D]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # the partial of dw per row slot of the tile, summed over the slots once at the end: a sum over the tile's
    # rows per tile would be a cross-warp (shared-memory) reduction in every iteration
    dw_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    tile = pid * tiles_per_program
    end = tl.minimum(tile + tiles_per_program, n_tiles)
    # a while loop: Triton's interpreter (the CPU tests) cannot run a `for` to a runtime bound under numpy 2.4
    while tile < end:
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if NEED_DW:
            dw_acc += g * xhat
        if NEED_DX:
            if HAS_WEIGHT:
                g = g * w[None, :]
            c = tl.sum(g * xhat, axis=1) / div
            dx = rstd[:, None] * (g - xhat * c[:, None])
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tile += 1
    if NEED_DW:
        tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


def _launch_shape(n_rows: int, D: int, tile: int = _TILE) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): whole rows per program, several when D is small; about 8 elements per
    thread (ptxas for sm_90: backward then needs <= 64 registers per thread at 32 warps, ~110 at 16; with 16
    elements per thread it needs ~180, and spills at D = 8192)."""
    block_d = triton.next_power_of_2(D)
    block_r = min(max(1, tile // block_d), triton.next_power_of_2(n_rows))
    num_warps = min(32, max(4, block_r * block_d // 256))
    return block_r, block_d, num_warps


# The launches: elements per row tile, warps (None: from _launch_shape) and, backward, programs per SM of its
# persistent grid. Names, so that benchmarks/bench_gpu_kernels.py --sweep can time others on a GPU.
FWD_LAUNCH = dict(tile=_TILE, num_warps=None)
BWD_LAUNCH = dict(tile=_TILE, num_warps=None, programs_per_sm=None)


def _tiles_per_program(device: torch.device, n_tiles: int, num_warps: int, programs_per_sm: int | None) -> int:
    """Backward's row tiles per program: a persistent grid just big enough to fill the GPU (32 warps per SM
    unless programs_per_sm says otherwise), so the [programs, D] partial sums of dw stay small. The
    interpreter gets 3 programs, so the tests cover several partials and a shorter last program."""
    if device.type != "cuda":
        return triton.cdiv(n_tiles, 3)
    per_sm = programs_per_sm or max(1, 32 // num_warps)
    return triton.cdiv(n_tiles, sm_count(device.index) * per_sm)


def norm_backward(x2d, weight, rstd, dy, div: float, need_dx: bool, need_dw: bool):
    """(dx [n_rows, D] or None, fp32 dw [D] or None) of y = x · rstd (⊙ weight) for upstream dy [n_rows, D]."""
    n_rows, D = x2d.shape
    dx = torch.empty_like(x2d) if need_dx else None
    block_r, block_d, num_warps = _launch_shape(n_rows, D, BWD_LAUNCH["tile"])
    num_warps = BWD_LAUNCH["num_warps"] or num_warps
    n_tiles = triton.cdiv(n_rows, block_r)
    tiles_per_program = _tiles_per_program(x2d.device, n_tiles, num_warps, BWD_LAUNCH["programs_per_sm"])
    programs = triton.cdiv(n_tiles, tiles_per_program)
    dw_partial = torch.empty(programs, D, dtype=torch.float32, device=x2d.device) if need_dw else None
    with on_device(x2d):
        _norm_bwd_kernel[(programs,)](
            x2d, x2d if weight is None else weight, rstd, dy, x2d if dx is None else dx,
            rstd if dw_partial is None else dw_partial, n_rows, D, div, tiles_per_program, n_tiles,
            HAS_WEIGHT=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return dx, None if dw_partial is None else dw_partial.sum(0)


def norm_forward(x, weight, eps: float, mean: bool):
    """(y like x, x as [n_rows, D], weight contiguous or None, rstd [n_rows] fp32, div) of one forward launch."""
    D = x.shape[-1]
    x2d = x.reshape(-1, D).contiguous()
    weight = None if weight is None else weight.contiguous()
    n_rows = x2d.shape[0]
    y = torch.empty_like(x2d)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    div = float(D) if mean else 1.0
    block_r, block_d, num_warps = _launch_shape(n_rows, D, FWD_LAUNCH["tile"])
    num_warps = FWD_LAUNCH["num_warps"] or num_warps
    with on_device(x):
        _norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
            x2d, x2d if weight is None else weight, y, rstd, n_rows, D, div, float(eps),
            HAS_WEIGHT=weight is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return y.view(x.shape), x2d, weight, rstd, div


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, mean):
        y, x2d, weight, rstd, div = norm_forward(x, weight, eps, mean)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape, ctx.div = x.shape, div
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x2d, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy = grad_y.reshape(x2d.shape).contiguous()
        dx, dw = norm_backward(x2d, weight, rstd, dy, ctx.div, need_dx, need_dw)
        grad_x = dx.view(ctx.x_shape) if need_dx else None
        grad_w = dw.to(weight.dtype) if need_dw else None
        return grad_x, grad_w, None, None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w ⊙ x / sqrt(mean(x²) + eps)` over the last dim; x [..., D] with 0 < D ≤ MAX_D, weight [D] or None.
    Without a gradient to track (inference) the launch goes straight, past autograd.Function's host work."""
    if not _needs_grad(x, weight):
        return norm_forward(x, weight, eps, True)[0]
    return _TritonNorm.apply(x, weight, eps, True)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x²) + eps)` over the last dim; x [..., D] with 0 < D ≤ MAX_D."""
    if not _needs_grad(x):
        return norm_forward(x, None, eps, False)[0]
    return _TritonNorm.apply(x, None, eps, False)
