"""MoonViT-V2 (SPEC §7): conv patch embedding + learned 64×64 position grid (resized bilinearly), 2D RoPE,
pre-norm blocks with block-diagonal attention over packed images (`cu_seqlens`), tanh-GELU MLP, final RMSNorm.
Parameter names are the released ones under `vision_tower.`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.norm import rms_norm
from k3.vision.config import VisionConfig

# RMSNorm "with no eps given": PyTorch's default, the float32 machine epsilon, also for bf16 inputs.
DEFAULT_EPS = torch.finfo(torch.float32).eps


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, DEFAULT_EPS)


class LearnedPosEmb(nn.Module):
    """A learned [H0, W0, D] grid; for a (h, w) patch grid it is resized bilinearly (align_corners False,
    no antialias) unless (h, w) == (H0, W0)."""

    def __init__(self, height: int, width: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, h: int, w: int) -> torch.Tensor:
        """→ [h·w, D] in row-major patch order."""
        grid = self.weight
        if (h, w) != tuple(grid.shape[:2]):
            g = grid.permute(2, 0, 1)[None].float()
            grid = F.interpolate(g, size=(h, w), mode="bilinear", align_corners=False, antialias=False)[0]
            grid = grid.permute(1, 2, 0).to(self.weight.dtype)
        return grid.reshape(h * w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        P, D = cfg.patch_size, cfg.vt_hidden_size
        self.proj = nn.Conv2d(3, D, kernel_size=P, stride=P, bias=False)
        self.pos_emb = LearnedPosEmb(cfg.init_pos_emb_height, cfg.init_pos_emb_width, D)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, 3, P, P]; grid_thws: [n, 3] → [N, D]."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        pos = torch.cat([self.pos_emb(int(h), int(w)) for t, h, w in grid_thws.tolist() for _ in range(int(t))])
        return x + pos


def rope_angles(grid_thws: torch.Tensor, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[N, head_dim/2] rotation angle of each (real) pair (2j, 2j+1) of every patch. Pair 2i (dims 4i, 4i+1)
    turns with the patch's column, pair 2i+1 (dims 4i+2, 4i+3) with its row, both at f_i = theta^(−4i/head_dim)."""
    nfreq = head_dim // 4
    freqs = theta ** (-4.0 * torch.arange(nfreq, dtype=torch.float64, device=device) / head_dim)
    rows, cols = [], []
    for t, h, w in grid_thws.tolist():
        r, c = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        rows += [r.reshape(-1)] * int(t)
        cols += [c.reshape(-1)] * int(t)
    row, col = torch.cat(rows).double(), torch.cat(cols).double()
    angles = torch.empty(row.shape[0], 2 * nfreq, dtype=torch.float64, device=device)
    angles[:, 0::2] = col[:, None] * freqs
    angles[:, 1::2] = row[:, None] * freqs
    return angles.float()


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x: [N, H, K]; angles: [N, K/2] → x with each pair (2j, 2j+1) rotated by angles[:, j], in fp32.
    As one complex multiply, (a + ib)·e^{iθ} = (a cos θ − b sin θ) + i(a sin θ + b cos θ): one elementwise pass
    where separate products, sums and a stack took six."""
    xc = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))
    rot = torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def attention_reference(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Non-causal attention within each image, one image at a time (the definition).
    q, k, v: [N, H, K]; cu_seqlens: [n + 1] → [N, H, K]."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[s:e].transpose(0, 1).float() for t in (q, k, v))  # [H, n, K]
        p = torch.softmax(qi @ ki.transpose(-1, -2) * scale, dim=-1)
        out[s:e] = (p @ vi).transpose(0, 1).to(q.dtype)
    return out


def attention_sdpa(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The same attention through SDPA without a mask (flash kernels on the GPU): each run of consecutive
    images of equal length is one batched call, so no [N, N] mask or score matrix is ever built.
    q, k, v: [N, H, K]; cu_seqlens: [n + 1] (a CPU tensor spares a device sync) → [N, H, K]."""
    H, K = q.shape[1:]
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    outs, i = [], 0
    while i < len(lens):
        j = i
        while j + 1 < len(lens) and lens[j + 1] == lens[i]:
            j += 1
        s, e, b = bounds[i], bounds[j + 1], j + 1 - i
        qi, ki, vi = (t[s:e].unflatten(0, (b, lens[i])).transpose(1, 2) for t in (q, k, v))  # [b, H, n, K]
        outs.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(e - s, H, K))
        i = j + 1
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def vision_attention(q, k, v, cu_seqlens):
    """Dispatch: SDPA per run of equal-size images on CUDA, the per-image reference elsewhere."""
    return attention_sdpa(q, k, v, cu_seqlens) if q.is_cuda else attention_reference(q, k, v, cu_seqlens)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=False)

    def forward(self, x):
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        D = cfg.vt_hidden_size
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = VisionRMSNorm(D)
        self.wqkv = nn.Linear(D, 3 * cfg.qkv_hidden_size, bias=False)  # q | k | v, each head-major
        self.wo = nn.Linear(cfg.qkv_hidden_size, D, bias=False)
        self.norm1 = VisionRMSNorm(D)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, angles, cu_seqlens, attn=vision_attention):
        """x: [N, D]; angles: [N, head_dim/2]; cu_seqlens: [n + 1]."""
        N = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(N, 3, self.heads, self.head_dim).unbind(1)
        h = x + self.wo(attn(apply_rope(q, angles), apply_rope(k, angles), v, cu_seqlens).reshape(N, -1))
        return h + self.mlp(self.norm1(h))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = VisionRMSNorm(cfg.vt_hidden_size)


class MoonViT(nn.Module):
    """The tower: packed patches of several images → [N, D] final-normed patch features."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor, attn=None) -> torch.Tensor:
        """pixel_values: [N, 3, P, P] (all images' patches, concatenated); grid_thws: [n, 3] (t, h, w) in patches.
        attn: an attention function (q, k, v, cu_seqlens) → out; default: dispatch by device."""
        grid_thws = check_grid(pixel_values, grid_thws, self.config)
        cfg = self.config
        x = self.patch_embed(pixel_values, grid_thws)
        lens = grid_thws[:, 0] * grid_thws[:, 1] * grid_thws[:, 2]
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])  # stays on the CPU: the attention reads it as ints
        angles = rope_angles(grid_thws, cfg.head_dim, cfg.rope_theta, device=x.device)
        for block in self.encoder.blocks:
            x = block(x, angles, cu, attn or vision_attention)
        return self.encoder.final_layernorm(x)


def check_grid(pixel_values, grid_thws, cfg: VisionConfig) -> torch.Tensor:
    """Clear errors for mismatched tower inputs; returns grid_thws as a [n, 3] int64 CPU tensor."""
    P = cfg.patch_size
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, P, P):
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise ValueError(f"pixel_values must be [num_patches, 3, {P}, {P}], got {shape}")
    g = torch.as_tensor(grid_thws, dtype=torch.long).cpu()
    if g.dim() != 2 or g.shape[1] != 3 or (g < 1).any():
        raise ValueError(f"grid_thws must be [num_images, 3] positive (t, h, w), got {g.tolist()}")
    if (g[:, 0] != 1).any():
        raise ValueError("only still images (t = 1) are supported; video chunks are not implemented")
    if int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) != pixel_values.shape[0]:
        raise ValueError(f"grid_thws {g.tolist()} describe {int((g.prod(1)).sum())} patches but pixel_values "
                         f"holds {pixel_values.shape[0]}")
    return g
