"""The one-launch decode candidate of the packed MXFP4 experts (k3.ops._mxfp4_triton.fused_selected_situ_mlp:
the down GEMM split along I inside the gate-and-up programs, an fp32 row per token by atomics) against
dequantise-then-matmul, both layouts, fp32 and bf16, a scale past 2^1 (decode bias), slots held elsewhere
(id < 0) skipped, and tiles that do not divide the shapes. On CUDA where there is one, else on the CPU under
the Triton interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from k3.ops import _mxfp4_triton  # noqa: E402
from k3.ops.mx_experts import packed_expert_situ_mlp_reference  # noqa: E402
from test_mxfp4_layout import DEVICE, Experts, rel_err  # noqa: E402


def weighted_reference(z, idx, wt, experts, E):
    """Σ_j wt[n, j] · expert idx[n, j] of z[n], one slot at a time, in float64 (slots with id < 0 add nothing)."""
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float64, device=z.device)
    for n in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            if idx[n, j] >= 0:
                one = torch.nn.functional.one_hot(idx[n, j], E)
                out[n] += wt[n, j].double() * packed_expert_situ_mlp_reference(z[n:n + 1].double(), one, experts)[0]
    return out


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("lo,hi,config", [(118, 124, (32, 64, 32, 4, 1)), (190, 200, (64, 32, 64, 4, 1)),
                                          (118, 124, (64, 64, 64, 4, 1))])  # L = 96: part tiles of 64
def test_fused_decode_matches_dequantize_then_matmul(decode, lo, hi, config):
    E = 4
    experts = Experts(E, 96, 64, lo, hi, seed=13)
    g = torch.Generator().manual_seed(14)
    idx = torch.tensor([[3, -1], [0, 2], [1, 3]], device=DEVICE)
    wt = torch.rand(3, 2, generator=g).to(DEVICE)
    z = (torch.randn(3, 96, generator=g) * 2.0 ** (118 - lo)).to(DEVICE)  # outputs stay finite in bf16
    ref = weighted_reference(z, idx, wt, experts, E)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = _mxfp4_triton.fused_selected_situ_mlp(z.to(dt), idx, wt, *experts.weights(decode), 4.0, 25.0,
                                                    config=config)
        assert out.dtype == dt and out.shape == (3, 96) and rel_err(out, ref) < tol, (dt, decode)


def test_fused_decode_refuses_mixed_layouts():
    experts = Experts(2, 64, 64, 118, 124, seed=7)
    released, decode = experts.weights(False), experts.weights(True)
    with pytest.raises(TypeError, match="one layout"):
        _mxfp4_triton.fused_selected_situ_mlp(torch.randn(1, 64, device=DEVICE), torch.tensor([[0]], device=DEVICE),
                                              torch.ones(1, 1, device=DEVICE), decode[0], released[1], decode[2],
                                              4.0, 25.0)
