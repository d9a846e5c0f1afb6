"""Block Attention Residuals (SPEC §3.1): a softmax mix over stored blocks and the live partial sum."""
import torch
from torch.autograd.function import once_differentiable

from k3.model.norm import RMSNorm
from k3.ops.norm import rms_norm
from k3.ops.triton_dispatch import triton_module, use_triton


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: torch.nn.Linear) -> torch.Tensor:
    """`out = Σ_i softmax_i(⟨RMSNorm_u(v_i), w⟩) · v_i` in fp32 over sources v_i: [B, T, D] each.

    `norm` holds the key norm weight u, `proj` the pseudo-query w as a [1, D] weight. For backward only the
    sources themselves and two [n, B, T] statistics are kept (not fp32 copies of the [n, B, T, D] stack).
    """
    x = sources[0]
    if x.numel() and use_triton(x, "_attn_res_triton") and all(s.dtype == x.dtype and s.shape == x.shape
                                                                 for s in sources):
        return _AttnResMixFused.apply(norm.weight, proj.weight, norm.eps, *sources)
    return _AttnResMix.apply(norm.weight, proj.weight, norm.eps, *sources)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _AttnResMix(torch.autograd.Function):
    """Forward: the SPEC formula on the stacked sources. Backward: recomputed one source at a time.

    With r_i = rsqrt(mean(v_i²) + eps), s_i = r_i ⟨v_i, u⊙w⟩, a = softmax(s), out = Σ a_i v_i and g = ∂L/∂out:
    ∂L/∂a_i = ⟨g, v_i⟩, ∂L/∂s_i = a_i (∂L/∂a_i − Σ_j a_j ∂L/∂a_j),
    ∂L/∂v_i = a_i g + ∂L/∂s_i (r_i u⊙w − s_i r_i² v_i / D), ∂L/∂u = w ⊙ q, ∂L/∂w = u ⊙ q with
    q = Σ_{i,b,t} ∂L/∂s_i r_i v_i.
    """

    @staticmethod
    def forward(ctx, u, w, eps, *sources):
        dt = _compute_dtype(sources[0])
        # autocast would run the two matmuls in bf16; the mix is fp32 (and backward assumes it)
        with torch.autocast(sources[0].device.type, enabled=False):
            v = torch.stack(sources).to(dt)  # [n, B, T, D]
            keys = rms_norm(v, u, eps)
            scores = keys @ w[0].to(dt)  # [n, B, T]
            a = torch.softmax(scores, dim=0)
            out = torch.einsum("nbt,nbtd->btd", a, v).to(sources[0].dtype)
        ctx.eps = eps
        ctx.save_for_backward(u, w, scores, a, *sources)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, w, scores, a, *sources = ctx.saved_tensors
        dt = scores.dtype
        g = grad_out.to(dt)
        uw = u.to(dt) * w[0].to(dt)
        D = g.shape[-1]
        da = torch.stack([(g * v.to(dt)).sum(-1) for v in sources])  # [n, B, T]
        ds = a * (da - (a * da).sum(0, keepdim=True))
        q = torch.zeros(D, dtype=dt, device=g.device)
        grads = []
        for v, a_i, ds_i, s_i in zip(sources, a, ds, scores):
            vf = v.to(dt)
            r = torch.rsqrt(vf.pow(2).mean(-1) + ctx.eps)  # [B, T]
            coef = (ds_i * r)[..., None]
            grads.append((a_i[..., None] * g + coef * uw - (coef * s_i[..., None] * r[..., None] / D) * vf).to(v.dtype))
            q += (coef * vf).flatten(0, -2).sum(0)
        du = (q * w[0].to(dt)).to(u.dtype)
        dw = (q * u.to(dt)).to(w.dtype)[None]
        return du, dw, None, *grads


class _AttnResMixFused(torch.autograd.Function):
    """`_AttnResMix` through k3.ops._attn_res_triton: one read of each source forward, two backward. Keeps the
    sources, the scores and one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, u, w, eps, *sources):
        kernels = triton_module("_attn_res_triton")
        sources = tuple(s.contiguous() for s in sources)
        out, scores, lse = kernels.mix_forward(u, w, eps, sources)
        ctx.eps = eps
        ctx.save_for_backward(u, w, scores, lse, *sources)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, w, scores, lse, *sources = ctx.saved_tensors
        du, dw, grads = triton_module("_attn_res_triton").mix_backward(grad_out, u, w, ctx.eps, tuple(sources),
                                                                      scores, lse)
        return du, dw, None, *grads
