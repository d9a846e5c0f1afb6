"""MoonViT-V2 throughput on one GPU: the released kimi-k3 vision tower (27 blocks, width 1024, 12 × 128 heads)
and projector, bf16, random weights, eval/no_grad; images/s and patches/s at 448², 896² and 1792², against the
bf16 matmul limit measured in the same run (SPEC §6 gives 790 TFLOP/s).

Inputs: random RGB images through k3's own preprocessing (`preprocess_image` + `batch_images`), packed with
cu_seqlens, 32,768 patches per batch: 32 × 448² (1,024 patches each), 8 × 896² (4,096), 2 × 1792² (16,384).
Only the model call is timed; pixels are already on the device.

FLOPs (matmuls only; norms, RoPE, GELU, softmax and adds are not counted), N patches in the batch, T_i of image i:
  patch embedding   2·N·(3·14·14)·1024
  per block         2·N·(1024·4608 + 1536·1024 + 1024·4096 + 4096·1024)   wqkv, wo, fc0, fc1
                  + Σ_i 4·T_i²·1536                                       q·kᵀ and p·v over 12 heads × 128
  × 27 blocks; projector rows add 2·(N/4)·(4096·4096 + 4096·7168) (proj.0, proj.2).
Rows per size (every tower row counts the same useful, block-diagonal FLOPs, so they compare by time):
  tower                          `attention_sdpa` (the CUDA default): SDPA (flash) per run of equal-size images
  tower+projector                the whole vision path: tower, 2×2 merge, projector (as `encode_images`)
  tower, reference attention     `attention_reference`: fp32 softmax(q·kᵀ)·v per image, scores materialised
  tower, one masked SDPA         all images in one SDPA call with an [N, N] block-diagonal mask
  peer: tower GEMMs alone        the 4 × 27 linear layers as bare F.linear at the same N (linear FLOPs only)
  peer: attention alone          `attention_sdpa` × 27 on random q, k, v (attention FLOPs only)
vs_matmul = TFLOP/s ÷ the measured 8192³ bf16 matmul. tower − GEMMs − attention ≈ the elementwise work.
Run: PYTHONPATH=src python benchmarks/bench_gpu_vision.py [--quick]   (--quick: a tiny tower on the CPU)
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import MATMUL_BF16, cpu_time_ms, measure_ceilings, save, table, time_ms  # noqa: E402

from k3.vision.config import VisionConfig  # noqa: E402
from k3.vision.preprocess import batch_images, preprocess_image  # noqa: E402
from k3.vision.projector import PatchMergerProjector, merge_patches  # noqa: E402
from k3.vision.tower import MoonViT, attention_reference, attention_sdpa  # noqa: E402

FULL_SIZES = {448: 32, 896: 8, 1792: 2}  # side in pixels → images per batch (32,768 patches each)
QUICK_SIZES = {56: 8, 112: 4, 224: 2}    # tiny tower on the CPU


def timer(device):
    """(fn, slow) → median ms: CUDA events on the GPU, perf_counter on the CPU; slow paths get fewer reps."""
    def run(fn, slow=False):
        warmup, reps = (1, 3) if slow else (3, 10)
        return time_ms(fn, warmup, reps) if device.type == "cuda" else cpu_time_ms(fn, warmup, reps)
    return run


def matmul_limit(device) -> float:
    """FLOP/s of a square matmul on this device, now: 8192³ bf16 on the GPU, 512³ fp32 on the CPU."""
    if device.type == "cuda":
        return measure_ceilings()["matmul_TFLOPs"] * 1e12
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return 2 * 512 ** 3 / (timer(device)(lambda: a @ b) * 1e-3)


def attention_block_mask(q, k, v, cu_seqlens):
    """All packed images in one SDPA call with an [N, N] block-diagonal boolean mask (for comparison)."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff()).to(q.device)
    mask = seg[:, None] == seg[None, :]
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask[None, None])
    return o[0].transpose(0, 1)


def build(cfg, device, dtype):
    """Tower + projector with random weights: ones for norms, N(0, 1/fan_in) for linear layers, N(0, 0.02)
    for the conv and the position grid (so activations stay O(1) through 27 blocks)."""
    torch.manual_seed(0)
    with torch.device(device):
        tower, proj = MoonViT(cfg), PatchMergerProjector(cfg)
    with torch.no_grad():
        for p in [*tower.parameters(), *proj.parameters()]:
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02)
    return tower.to(dtype).eval(), proj.to(dtype).eval()


def images(side, count, cfg):
    """`count` random side × side RGB images through k3's preprocessing → (pixel_values, grid_thws)."""
    from PIL import Image

    rng = np.random.default_rng(side)
    pil = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB") for _ in range(count)]
    return batch_images([preprocess_image(im, cfg) for im in pil])


def flops(cfg, grid_thws):
    """(linear, attention, projector) FLOPs of one batch, by the formula in the module docstring."""
    D, Q, I, L, P = (cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.vt_num_hidden_layers,
                     cfg.patch_size)
    T = grid_thws.prod(1).tolist()
    N = sum(T)
    linear = 2 * N * 3 * P * P * D + L * 2 * N * (D * 3 * Q + Q * D + 2 * D * I)
    attention = L * sum(4 * t * t * Q for t in T)
    projector = 2 * (N // cfg.merge_area) * (cfg.mm_hidden_size ** 2 + cfg.mm_hidden_size * cfg.text_hidden_size)
    return linear, attention, projector


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny vision config on the CPU (checks the script runs)")
    a = ap.parse_args()
    device = torch.device("cpu" if a.quick else "cuda")
    dtype = torch.float32 if a.quick else torch.bfloat16
    cfg = VisionConfig.preset("tiny" if a.quick else "kimi-k3")
    tower, proj = build(cfg, device, dtype)
    measure = timer(device)
    limit = matmul_limit(device)
    print(f"matmul limit now: {limit / 1e12:.3g} TFLOP/s (SPEC §6: {MATMUL_BF16 / 1e12:.0f} bf16 on H200)", flush=True)
    H, K = cfg.vt_num_attention_heads, cfg.head_dim
    blocks = tower.encoder.blocks
    rows = []
    for side, count in (QUICK_SIZES if a.quick else FULL_SIZES).items():
        px, grid = images(side, count, cfg)
        px = px.to(device)
        N = px.shape[0]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), grid.prod(1).cumsum(0)])
        linear, attention, projector = flops(cfg, grid)
        q, k, v = torch.randn(N, 3, H, K, device=device, dtype=dtype).unbind(1)  # laid out as wqkv's output
        xs = {w: torch.randn(N, w, device=device, dtype=dtype) for w in (cfg.vt_hidden_size, cfg.qkv_hidden_size,
                                                                         cfg.vt_intermediate_size)}

        def gemms():
            for b in blocks:
                for lin in (b.wqkv, b.wo, b.mlp.fc0, b.mlp.fc1):
                    F.linear(xs[lin.in_features], lin.weight)

        def attention_only():
            for _ in blocks:
                attention_sdpa(q, k, v, cu)

        cases = [("tower", lambda: tower(px, grid, attn=attention_sdpa), linear + attention, False),
                 ("tower+projector", lambda: proj(merge_patches(tower(px, grid, attn=attention_sdpa), grid)),
                  linear + attention + projector, False),
                 ("tower, reference attention", lambda: tower(px, grid, attn=attention_reference),
                  linear + attention, True),
                 ("tower, one masked SDPA", lambda: tower(px, grid, attn=attention_block_mask), linear + attention,
                  True),
                 ("peer: tower GEMMs alone", gemms, linear - 2 * N * 3 * cfg.patch_size ** 2 * cfg.vt_hidden_size,
                  False),
                 ("peer: attention alone", attention_only, attention, False)]
        with torch.no_grad():
            fast = tower(px, grid, attn=attention_sdpa).float()
            ref = tower(px, grid, attn=attention_reference).float()
            rel_err = float((fast - ref).norm() / ref.norm())
            for name, fn, fl, slow in cases:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    ms = measure(fn, slow)
                except torch.OutOfMemoryError:
                    rows.append(dict(side=side, images=count, patches=N, path=name + " (OOM)"))
                    print(rows[-1], flush=True)
                    continue
                row = dict(side=side, images=count, patches=N, path=name, ms=ms, images_per_s=count / ms * 1e3,
                           patches_per_s=N / ms * 1e3, TFLOPs=fl / ms * 1e-9, vs_matmul=fl / ms * 1e3 / limit,
                           GFLOP=fl / 1e9)
                if name.startswith("peer"):
                    del row["images_per_s"], row["patches_per_s"]
                if device.type == "cuda":
                    row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
                if name == "tower":
                    row["rel_err_vs_reference"] = rel_err
                rows.append(row)
                print(row, flush=True)
    print(f"dtype {dtype}; matmul limit measured now {limit / 1e12:.3g} TFLOP/s; FLOP formula in the docstring")
    print(table(rows, ["side", "images", "patches", "path", "ms", "images_per_s", "patches_per_s", "GFLOP",
                       "TFLOPs", "vs_matmul", "peak_GiB", "rel_err_vs_reference"]))
    if device.type == "cuda":  # the environment stamp asks the CUDA device for its name
        save("vision", {"matmul_limit_TFLOPs": limit / 1e12, "dtype": str(dtype), "rows": rows,
                        "sizes": {str(s): n for s, n in FULL_SIZES.items()}})


if __name__ == "__main__":
    main()
