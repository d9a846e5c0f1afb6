"""Block Attention Residuals (SPEC §3.1): a softmax mix over stored blocks and the live partial sum."""
import torch

from k3.model.norm import RMSNorm
from k3.ops.norm import rms_norm


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: torch.nn.Linear) -> torch.Tensor:
    """`out = Σ_i softmax_i(⟨RMSNorm_u(v_i), w⟩) · v_i` in fp32 over sources v_i: [B, T, D] each.

    `norm` holds the key norm weight u, `proj` the pseudo-query w as a [1, D] weight.
    """
    dt = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    v = torch.stack(sources).to(dt)  # [n, B, T, D]
    keys = rms_norm(v, norm.weight, norm.eps)
    scores = keys @ proj.weight[0].to(dt)  # [n, B, T]
    a = torch.softmax(scores, dim=0)
    return torch.einsum("nbt,nbtd->btd", a, v).to(sources[0].dtype)
