"""k3's Triton MXFP4 expert GEMMs (k3.ops._mxfp4_triton) against dequantise-then-matmul (the packed experts'
reference), at bf16 and fp32 tolerances: grouped (rows sorted by expert, ragged counts with zeros, counts on
the device) and selected (decode: each slot reads its own expert), on small shapes and K3's released expert
shape (latent 3584, intermediate 3072, top-16 of 896), captured in CUDA graphs, and inside a packed model
whose decode steps are now graphs. Marked `gpu` and skipped without CUDA, like tests/test_gpu.py.
"""
import pytest
import torch

from k3 import envs
from k3.ops.moe_decode import selected_experts_situ_mlp_reference
from k3.ops.mx import mxfp4_unpack
from k3.ops.mx_experts import (packed_expert_situ_mlp, packed_expert_situ_mlp_reference,
                               packed_kernels_enabled, packed_selected_experts_situ_mlp)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _kernels():
    if not packed_kernels_enabled():
        pytest.skip("triton not importable")


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel's output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class PackedExperts(torch.nn.Module):
    """Random packed MXFP4 experts: every byte pattern of the codes (random nibbles, signed zeros included) and
    scale bytes spread so that the weights' scale is ~ 1/sqrt(fan-in); one all-zero block with scale byte 0."""

    def __init__(self, E, L, I, seed, device="cuda"):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(seed)
        for name, (out, inp) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
            centre = 127 - 2 - round(0.5 * torch.log2(torch.tensor(float(inp))).item())  # codes reach 6: ×4
            packed = torch.randint(0, 256, (E, out, inp // 2), generator=g, device=device, dtype=torch.uint8)
            scale = torch.randint(centre - 2, centre + 2, (E, out, inp // 32), generator=g, device=device,
                                  dtype=torch.uint8)
            packed[0, 0, :16], scale[0, 0, 0] = 0, 0  # E8M0 byte 0 (2^-127) on a zero block
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)
        self.packed = True

    def dense(self, name, experts, dtype=torch.float64):
        return mxfp4_unpack(getattr(self, f"{name}_packed")[experts], getattr(self, f"{name}_scale")[experts], dtype)


@pytest.mark.parametrize("E,L,I,counts", [
    (6, 256, 128, [40, 0, 1, 130, 0, 17]),  # one expert over two 64-row tiles, zeros between
    (5, 352, 96, [0, 3, 0, 0, 9]),  # in-features not a multiple of the K tile, leading zero count
    (4, 64, 64, [0, 0, 0, 0]),  # no rows at all
])
def test_grouped_kernel_matches_dequantize_then_matmul(E, L, I, counts):
    experts = PackedExperts(E, L, I, seed=1)
    counts = torch.tensor(counts, device="cuda")
    x = torch.randn(int(counts.sum()), L, device="cuda")
    ref = packed_expert_situ_mlp_reference(x.double(), counts, experts)
    for dt, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        out = packed_expert_situ_mlp(x.to(dt), counts, experts)
        assert out.dtype == dt and out.shape == ref.shape
        if ref.numel():
            assert rel_err(out, ref) < tol, dt


def _selected_reference(z, idx, wt, experts):
    """`selected_experts_situ_mlp_reference` on float64 copies of only the selected experts (K3's 896 experts
    would not fit in float64)."""
    used, local = torch.unique(idx, return_inverse=True)
    w1, w3, w2 = (experts.dense(n, used) for n in ("w1", "w3", "w2"))
    return selected_experts_situ_mlp_reference(z.double(), local, wt.double(), w1, w3, w2)


@pytest.mark.parametrize("E,L,I,k,N", [(16, 256, 192, 4, 3), (896, 3584, 3072, 16, 1), (896, 3584, 3072, 16, 4)])
def test_selected_kernel_matches_reference(E, L, I, k, N):
    """Decode: slots read their experts in place; two tokens may pick the same expert; K3's released shape."""
    experts = PackedExperts(E, L, I, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(N, L, device="cuda", generator=g)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(N)])
    if N > 1:
        idx[1, 0] = idx[0, 0]  # a shared expert
    wt = torch.rand(N, k, device="cuda", generator=g)
    ref = _selected_reference(z, idx, wt, experts)
    for dt, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        out = packed_selected_experts_situ_mlp(z.to(dt), idx, wt.to(dt), experts)
        assert out.dtype == dt and rel_err(out, ref) < tol, dt


def test_grouped_kernel_at_k3_shape_with_ragged_counts():
    """K3's expert shape, 64 tokens × top-16 of 896 (the batch-64 decode step): 1024 rows over ~600 experts,
    most with one or two rows, many with none."""
    E, L, I, k, T = 896, 3584, 3072, 16, 64
    experts = PackedExperts(E, L, I, seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).flatten()
    counts = torch.zeros(E, dtype=torch.long, device="cuda").scatter_add_(0, idx, torch.ones_like(idx))
    assert int((counts == 0).sum()) > 100 and int(counts.max()) > 1
    x = torch.randn(T * k, L, device="cuda", generator=g).bfloat16()
    ref = packed_expert_situ_mlp_reference(x.double(), counts, experts)
    out = packed_expert_situ_mlp(x, counts, experts)
    assert rel_err(out, ref) < 2e-2


def test_kernels_replay_in_a_cuda_graph_with_new_counts():
    """Captured once, replayed after the counts (on the device) and the rows change in place: equals the
    reference for the new counts, so nothing of the first counts was baked in on the host."""
    E, L, I, S = 8, 256, 128, 96
    experts = PackedExperts(E, L, I, seed=6)
    x = torch.randn(S, L, device="cuda").bfloat16()
    counts = torch.tensor([10, 0, 30, 6, 0, 0, 40, 10], device="cuda")
    z, idx = torch.randn(2, L, device="cuda").bfloat16(), torch.tensor([[1, 5], [5, 7]], device="cuda")
    wt = torch.rand(2, 2, device="cuda").bfloat16()
    packed_expert_situ_mlp(x, counts, experts)  # compile outside the capture
    packed_selected_experts_situ_mlp(z, idx, wt, experts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed_expert_situ_mlp(x, counts, experts)
        sel = packed_selected_experts_situ_mlp(z, idx, wt, experts)
    counts.copy_(torch.tensor([0, 50, 0, 1, 45, 0, 0, 0]))
    x.copy_(torch.randn(S, L, device="cuda"))
    idx.copy_(torch.tensor([[0, 3], [3, 2]]))
    graph.replay()
    assert rel_err(out, packed_expert_situ_mlp_reference(x.double(), counts, experts)) < 2e-2
    assert rel_err(sel, _selected_reference(z, idx, wt, experts)) < 2e-2


@pytest.mark.parametrize("decode_layout", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_packed_model_decodes_in_cuda_graphs(batch, decode_layout):
    """A tiny model with packed MXFP4 experts: no graph blocker now; graphed decode steps == eager steps, and
    the kernels' eager logits == the reference path's (K3_NO_TRITON=_mxfp4_triton) at bf16 tolerance.
    Batch 1 takes the selected (decode) kernels, batch 3 the grouped ones (tiny: 4 of 16 experts a token);
    decode_layout: the experts' bytes rearranged for the kernels (use_decode_layout_), the reference reading
    them back."""
    from k3.config import K3Config
    from k3.model.cuda_graph import GraphedDecodeStep, graph_blocker
    from k3.model.decoder import K3ForCausalLM
    from k3.model.generate import chunked_prefill
    from k3.ops.mx_experts import pack_experts_, use_decode_layout_

    torch.manual_seed(7)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().to(torch.bfloat16).eval()
    for m in model.modules():
        if getattr(m, "packed", None) is False and hasattr(m, "w1"):
            pack_experts_(m)
    if decode_layout:
        cfg = model.config
        assert use_decode_layout_(model) == sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) > 0
    assert graph_blocker(model) is None
    with envs.override(no_triton="_mxfp4_triton"):
        assert "K3_NO_TRITON" in graph_blocker(model)
    T, n = 20, 4
    ids = torch.randint(0, model.config.vocab_size, (batch, T + n), device="cuda")
    with torch.no_grad():
        caches = [model.new_cache(batch, T + n) for _ in range(3)]
        for c in caches[:2]:
            chunked_prefill(model, ids[:, :T], c, 8)
        with envs.override(no_triton="_mxfp4_triton"):
            chunked_prefill(model, ids[:, :T], caches[2], 8)
        step = GraphedDecodeStep(model, caches[1])
        for t in range(T, T + n):
            eager = model(ids[:, t:t + 1], cache=caches[0]).logits[:, 0].float()
            graphed = step.step(ids[:, t]).float()
            with envs.override(no_triton="_mxfp4_triton"):
                ref = model(ids[:, t:t + 1], cache=caches[2]).logits[:, 0].float()
            assert rel_err(graphed, eager) < 1e-2 and rel_err(eager, ref) < 2e-2, t


@pytest.mark.parametrize("config", [(16, 64, 128, 4, 3, False), (64, 128, 64, 4, 4, False),
                                    (16, 64, 128, 4, 3, True), (64, 128, 64, 4, 4, True)])
def test_tile_configs_match_reference(config):
    """Each operand order and tile shape the benchmark sweeps (k3.ops._mxfp4_triton.tile_config's choices among
    them), grouped and selected, bf16: the weights as the dot's left or right operand give the same products."""
    from k3.ops.mx_experts import EXPERT_ORDER
    from k3.ops.triton_dispatch import triton_module

    mod = triton_module("_mxfp4_triton")
    E, L, I = 6, 384, 256
    experts = PackedExperts(E, L, I, seed=9)
    w = [(getattr(experts, f"{n}_packed"), getattr(experts, f"{n}_scale")) for n in EXPERT_ORDER]
    counts = torch.tensor([70, 0, 3, 1, 0, 130], device="cuda")
    x = torch.randn(int(counts.sum()), L, device="cuda")
    out = mod.grouped_situ_mlp(x.bfloat16(), counts, *w, 4.0, 25.0, config=config)
    assert rel_err(out, packed_expert_situ_mlp_reference(x.double(), counts, experts)) < 2e-2
    z, idx = torch.randn(2, L, device="cuda"), torch.tensor([[0, 5, 2], [5, 3, 1]], device="cuda")
    y = mod.selected_situ_mlp(z.bfloat16(), idx, *w, 4.0, 25.0, config=config)
    per_slot = torch.stack([_selected_reference(z[n:n + 1], idx[n:n + 1, j:j + 1], torch.ones(1, 1, device="cuda"),
                                                experts)[0] for n in range(2) for j in range(3)])
    assert rel_err(y, per_slot) < 2e-2
