"""Causal depthwise short convolution with a carried tail (KDA's q/k/v convs), float32 weights and state."""
import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
               doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv: `y[t, c] = Σ_j weight[c, 0, j] · x[t − (W−1) + j, c]`.

    x: [B, T, C]; weight: [C, 1, W]; tail: [B, W−1, C], the previous W−1 inputs (zeros when None).
    doc_ids: [B, T] for packed rows; taps that reach into another document read zero.
    Returns (y [B, T, C] in x's dtype, new tail [B, W−1, C] in the compute dtype).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(dt)
    if tail is None:
        tail = xf.new_zeros(B, W - 1, C)
    xp = torch.cat([tail.to(dt), xf], dim=1)  # [B, T+W-1, C]
    w = weight.to(dt)
    if doc_ids is None:
        y = F.conv1d(xp.transpose(1, 2), w, groups=C).transpose(1, 2)
    else:
        win = xp.unfold(1, W, 1)  # [B, T, C, W]; win[..., j] is x[t - (W-1) + j]
        d = F.pad(doc_ids, (W - 1, 0), value=-1).unfold(1, W, 1)  # [B, T, W]
        same = (d == doc_ids.unsqueeze(-1)).to(dt)
        y = torch.einsum("btcw,cw,btw->btc", win, w[:, 0, :], same)
    return y.to(x.dtype), xp[:, xp.shape[1] - (W - 1):]
