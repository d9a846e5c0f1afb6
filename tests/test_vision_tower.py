"""MoonViT-V2 and the projector (SPEC §7): RoPE axes and merge order against hand-built cases, packed == separate
images, the GPU attention path against the reference, position-grid resizing, norms, and the released names,
shapes and counts from a meta-device build."""
import math

import torch

from k3.config import K3Config
from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration, vision_parameter_count
from k3.vision.projector import PatchMergerProjector, merge_patches
from k3.vision.tower import (LearnedPosEmb, MoonViT, VisionRMSNorm, apply_rope, attention_reference,
                             attention_sdpa, rope_angles)



def test_rope_column_on_even_pairs_row_on_odd_pairs():
    K, theta = 16, 10000.0
    grid = torch.tensor([[1, 2, 3]])  # 2 rows × 3 columns
    x = torch.randn(6, 1, K, dtype=torch.float64)
    y = apply_rope(x, rope_angles(grid, K, theta)).double()
    for n in range(6):
        row, col = divmod(n, 3)
        for i in range(K // 4):
            f = theta ** (-4 * i / K)
            for d, pos in ((4 * i, col), (4 * i + 2, row)):  # dims (4i, 4i+1): column; (4i+2, 4i+3): row
                a, b = float(x[n, 0, d]), float(x[n, 0, d + 1])
                c, s = math.cos(pos * f), math.sin(pos * f)
                assert abs(float(y[n, 0, d]) - (a * c - b * s)) < 1e-5
                assert abs(float(y[n, 0, d + 1]) - (a * s + b * c)) < 1e-5


def test_merge_order_is_tl_tr_bl_br_row_major():
    h, w, D = 4, 6, 2
    feats = torch.arange(h * w, dtype=torch.float32)[:, None].repeat(1, D)  # patch index in every channel
    out = merge_patches(feats, torch.tensor([[1, h, w]]))
    assert out.shape == (h // 2 * w // 2, 4 * D)
    for r in range(h // 2):
        for c in range(w // 2):
            tl = (2 * r) * w + 2 * c
            want = [tl, tl + 1, tl + w, tl + w + 1]  # top-left, top-right, bottom-left, bottom-right
            got = out[r * (w // 2) + c].reshape(4, D)[:, 0].tolist()
            assert got == want


def test_conv_patch_embedding_reads_patches_channel_first():
    cfg = VisionConfig.preset("tiny")
    tower = MoonViT(cfg).double()
    px = torch.randn(4, 3, 14, 14, dtype=torch.float64)
    W = tower.patch_embed.proj.weight  # [D, 3, 14, 14]
    want = px.reshape(4, -1) @ W.reshape(W.shape[0], -1).T  # (c, y, x) flattening
    assert torch.allclose(tower.patch_embed.proj(px).flatten(1), want, atol=1e-10)


def test_position_grid_resize_is_bilinear_without_align_corners():
    emb = LearnedPosEmb(4, 8, 1).double()
    with torch.no_grad():
        emb.weight.copy_(torch.arange(8, dtype=torch.float64).view(1, 8, 1).expand(4, 8, 1))  # value = column
    assert torch.equal(emb(4, 8), emb.weight.reshape(32, 1))  # native size: untouched
    out = emb(2, 5).view(2, 5)
    for j in range(5):  # align_corners=False: source x = (j + 0.5) · 8/5 − 0.5, clamped to the grid
        src = min(max((j + 0.5) * 8 / 5 - 0.5, 0.0), 7.0)
        assert abs(float(out[0, j]) - src) < 1e-5 and abs(float(out[1, j]) - src) < 1e-5  # resized in fp32


def test_vision_rmsnorm_uses_float32_machine_epsilon():
    norm = VisionRMSNorm(4)
    x = torch.full((1, 4), 1e-4)
    want = 1e-4 / math.sqrt(1e-8 + 2.0 ** -23)
    assert abs(float(norm(x)[0, 0]) - want) < 1e-4 * want
    assert abs(float(norm(x.bfloat16()).float()[0, 0]) - want) < 1e-2 * want


def _tiny_tower():
    torch.manual_seed(0)
    tower = MoonViT(VisionConfig.preset("tiny")).double()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    return tower


def test_two_images_packed_equal_separate_runs():
    tower = _tiny_tower()
    g1, g2 = torch.tensor([[1, 2, 4]]), torch.tensor([[1, 6, 2]])
    p1 = torch.randn(8, 3, 14, 14, dtype=torch.float64)
    p2 = torch.randn(12, 3, 14, 14, dtype=torch.float64)
    packed = tower(torch.cat([p1, p2]), torch.cat([g1, g2]))
    sep = torch.cat([tower(p1, g1), tower(p2, g2)])
    assert torch.allclose(packed, sep, atol=1e-10)
    # and the image really is attended as a whole: changing one patch changes the others' features
    p1b = p1.clone()
    p1b[0] += 1
    assert not torch.allclose(tower(p1b, g1)[1:], tower(p1, g1)[1:])


def test_sdpa_path_equals_reference_over_runs_of_equal_images():
    """The GPU path batches consecutive equal-length images: runs of 1, 2 and 3 images, lengths repeating
    after a different one, and q, k, v as strided views of one wqkv output (as in the tower)."""
    g = torch.Generator().manual_seed(0)
    lens = [5, 4, 4, 6, 6, 6, 4]
    N = sum(lens)
    q, k, v = torch.randn(N, 3, 3, 8, dtype=torch.float64, generator=g).unbind(1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    got, want = attention_sdpa(q, k, v, cu), attention_reference(q, k, v, cu)
    assert got.shape == want.shape == (N, 3, 8)
    assert torch.allclose(got, want, atol=2e-6)  # the reference computes in fp32
    # attention stays within each image: moving a key of the last image changes only that image's outputs
    k2 = k.clone()
    k2[-1] += 1.0
    moved = attention_sdpa(q, k2, v, cu)
    assert torch.equal(moved[:-4], got[:-4]) and not torch.allclose(moved[-4:], got[-4:])


def test_tower_sdpa_path_equals_reference_path():
    tower = _tiny_tower()
    grids = torch.tensor([[1, 2, 4], [1, 2, 4], [1, 4, 2], [1, 6, 2], [1, 6, 2]])
    px = torch.randn(int(grids.prod(1).sum()), 3, 14, 14, dtype=torch.float64)
    fast = tower(px, grids, attn=attention_sdpa)
    assert torch.allclose(fast, tower(px, grids, attn=attention_reference), atol=1e-5)  # fp32 reference


def test_projector_is_linear_erf_gelu_linear_rmsnorm():
    cfg = VisionConfig.preset("tiny")
    proj = PatchMergerProjector(cfg).double()
    with torch.no_grad():
        for p in proj.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(3, cfg.mm_hidden_size, dtype=torch.float64)
    h = x @ proj.proj[0].weight.T
    h = h * 0.5 * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU, not tanh
    h = h @ proj.proj[2].weight.T
    want = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * proj.post_norm.weight
    assert torch.allclose(proj(x), want, atol=1e-10)


def test_released_vision_names_shapes_and_counts_on_meta():
    counts = vision_parameter_count(VisionConfig())
    assert counts["vision_tower"] == 401_214_464 and counts["mm_projector"] == 46_144_512
    assert counts["vision_tower"] + counts["mm_projector"] == 447_358_976
    assert counts["tensors"] == (165, 3)
    with torch.device("meta"):
        tower, proj = MoonViT(VisionConfig()), PatchMergerProjector(VisionConfig())
    shapes = {f"vision_tower.{n}": tuple(t.shape) for n, t in tower.state_dict().items()}
    shapes |= {f"mm_projector.{n}": tuple(t.shape) for n, t in proj.state_dict().items()}
    want = {"vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
            "vision_tower.encoder.final_layernorm.weight": (1024,),
            "mm_projector.proj.0.weight": (4096, 4096), "mm_projector.proj.2.weight": (7168, 4096),
            "mm_projector.post_norm.weight": (7168,)}
    for L in range(27):
        b = f"vision_tower.encoder.blocks.{L}."
        want |= {b + "norm0.weight": (1024,), b + "wqkv.weight": (4608, 1024), b + "wo.weight": (1024, 1536),
                 b + "norm1.weight": (1024,), b + "mlp.fc0.weight": (4096, 1024), b + "mlp.fc1.weight": (1024, 4096)}
    assert shapes == want


def test_full_kimi_k3_counts_on_meta():
    text = K3Config.preset("kimi-k3")
    with torch.device("meta"):
        model = K3ForConditionalGeneration(text, VisionConfig(), init=False)
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    # the published total counts A_log as stored: zero-padded 96 → 128 in each of the 69 KDA layers
    n_kda = sum(not text.is_mla(l) for l in range(text.num_hidden_layers))
    assert n + n_kda * (128 - 96) == 2_779_931_837_184
    names = [k for k in model.state_dict() if k.startswith(("vision_tower.", "mm_projector."))]
    assert len(names) == 168
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in model.state_dict())
