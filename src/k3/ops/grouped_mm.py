"""Routed-expert GEMMs: a per-expert loop reference and a `torch._grouped_mm` fast path."""
import torch

from k3.ops.fused_situ import situ_glu_fast, situ_glu_joined
from k3.ops.host_sync import host_reads_forbidden
from k3.ops.situ import situ_glu


def expert_situ_mlp_loop(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                         beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """Reference: rows of x sorted by expert, `counts[e]` rows for expert e; `y = W2_e SiTU(W1_e x, W3_e x)`.

    x: [S, D]; w1, w3: [E, I, D]; w2: [E, D, I] (checkpoint `[out, in]` layout). Returns [S, D].
    """
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        h = situ_glu(xe @ w1[e].t(), xe @ w3[e].t(), beta_gate, beta_up)
        outs.append(h @ w2[e].t())
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """`_grouped_mm` takes fp32/bf16/fp16 with 16-byte aligned rows; float64 (tests) uses the loop."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    align = 16 // x.element_size()
    return all(d % align == 0 for w in weights for d in w.shape[1:])


def host_offsets_forbidden(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True while a CUDA graph captures or torch.compile traces and `_grouped_mm` could not take x: its kernel
    (and its fake-tensor rule, which tracing runs) takes aligned bf16 only, and its fallback for other dtypes,
    like the loop, reads the offsets on the host, which capture forbids and which splits a compiled graph."""
    return host_reads_forbidden(x) and not (x.dtype == torch.bfloat16 and grouped_mm_supported(x, *weights))


def rows_linear(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-expert `x_e @ W_e^T` with each row's expert weights gathered: no step reads `counts` on the host, so
    it can be captured in a CUDA graph. Memory grows as rows × expert size: for decode-sized batches."""
    eid = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                  output_size=x.shape[0])  # output_size: no host sync
    return torch.bmm(w[eid], x[:, :, None])[..., 0]


def grouped_linear(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-expert `x_e @ W_e^T`. x: [S, in] sorted by expert; counts: [E] int; w: [E, out, in] → [S, out].
    One `_grouped_mm` where it can run; per-row gathered weights while a CUDA graph captures (or torch.compile
    traces) what it cannot take; else a loop over the experts."""
    if w.dtype != x.dtype:  # autocast does not cover _grouped_mm: bf16 activations meet fp32 master weights
        w = w.to(x.dtype)
    if host_offsets_forbidden(x, w):
        return rows_linear(x, counts, w)
    if x.shape[0] and grouped_mm_supported(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.cumsum(counts, 0).to(torch.int32))
    parts = [xe @ we.t() for xe, we in zip(x.split(counts.tolist()), w)]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


def joined_gate_up(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[W1_e; W3_e] stacked along the output dim ([E, 2I, L]) in `dtype`, each cast straight into its half (one
    pass, not a cast and then a copy). One `cat`: its batched copy is vectorised, where assigning each half (a
    strided destination) took CUDA's generic elementwise copy at about half the bandwidth (session 40's H100
    profile of small: ~4 ms a step for these joins and the gradient copies below)."""
    E, I, L = w1.shape
    return torch.cat((w1, w3), 1, out=w1.new_empty(E, 2 * I, L, dtype=dtype))


class _JoinedGateUp(torch.autograd.Function):
    """gu = [x W1_eᵀ | x W3_eᵀ] per expert: one `_grouped_mm` over `joined_gate_up`. Keeps x and the weights as
    given (parameters, or autocast's casts), not the joined copy, and joins them again in backward: no
    weight-sized copy is held from forward to backward. Backward: ∂L/∂x in one GEMM, ∂L/∂W1 and ∂L/∂W3 in one
    each."""

    @staticmethod
    def forward(ctx, x, w1, w3, offs):
        ctx.save_for_backward(x, w1, w3, offs)
        return torch._grouped_mm(x, joined_gate_up(w1, w3, x.dtype).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dgu):
        x, w1, w3, offs = ctx.saved_tensors
        dgu = dgu.contiguous()  # (_grouped_mm's backward wants a dense gradient)
        dx = dw1 = dw3 = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dgu, joined_gate_up(w1, w3, x.dtype), offs=offs)
        # each weight's gradient from its half of dgu, [E, I, L] in the weights' own layout (as autograd's own
        # backward of a transposed weight computes it): contiguous, so AccumulateGrad takes it as it is, where
        # halves of one [E, 2I, L] product would each be copied into a gradient of the parameter's layout
        I = w1.shape[1]
        if ctx.needs_input_grad[1]:
            dw1 = torch._grouped_mm(dgu[:, :I].t(), x, offs=offs).to(w1.dtype)
        if ctx.needs_input_grad[2]:
            dw3 = torch._grouped_mm(dgu[:, I:].t(), x, offs=offs).to(w3.dtype)
        return dx, dw1, dw3, None


def expert_situ_mlp_grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                            w2: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """Same contract as the loop, with `torch._grouped_mm` for the projections. counts: [E] int tensor.

    Where a gradient is recorded, gate and up are one GEMM over the joined weight (`_JoinedGateUp`) and the GLU
    writes its gradient joined the same way (`situ_glu_joined`): backward then takes ∂L/∂x in one GEMM, where
    two would each write a [slots, L] gradient for autograd to sum (session 39's H100 profile of `small`: 0.39 ms
    a layer for that sum alone). Without a gradient the weights stay apart: joining them is a copy of the
    weights each call, which inference need not pay."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w3.requires_grad):
        h = situ_glu_joined(_JoinedGateUp.apply(x, w1, w3, offs), beta_gate, beta_up)
    else:
        g = torch._grouped_mm(x, w1.to(x.dtype).transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(x, w3.to(x.dtype).transpose(-2, -1), offs=offs)
        h = situ_glu_fast(g, u, beta_gate, beta_up)  # one fused Triton pass on CUDA, the reference elsewhere
    return torch._grouped_mm(h, w2.to(x.dtype).transpose(-2, -1), offs=offs)


def expert_situ_mlp(x, counts: torch.Tensor, w1, w3, w2, beta_gate=4.0, beta_up=25.0) -> torch.Tensor:
    """Dispatch: the three grouped GEMMs on one set of offsets where `_grouped_mm` takes them, else the same
    products through `grouped_linear` (per-row weights in a CUDA-graph capture or torch.compile, a loop over
    experts elsewhere)."""
    if x.shape[0] and grouped_mm_supported(x, w1, w2) and not host_offsets_forbidden(x, w1, w2):
        # (autocast does not cover _grouped_mm: bf16 activations meet fp32 master weights, cast in there)
        return expert_situ_mlp_grouped(x, counts, w1, w3, w2, beta_gate, beta_up)
    if w1.dtype != x.dtype:
        w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
    h = situ_glu_fast(grouped_linear(x, counts, w1), grouped_linear(x, counts, w3), beta_gate, beta_up)
    return grouped_linear(h, counts, w2)
