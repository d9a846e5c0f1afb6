"""K3_FLA_KEEP_FORWARD: fla's chunked KDA keeping its forward's intermediates for the backward (disable_recompute).

On the CPU: the switch parses, and k3.ops.kda_fla asks fla for it only in a call that will be differentiated and only
when switched on (fla replaced by a recorder). On CUDA (marked gpu, needs fla): the gated op's output and every input
gradient with the switch on equal the switch off (the same kernels on kept rather than recomputed tensors), and both
stay within bf16 tolerance of the float64 reference composition.
"""

import pytest
import torch
import torch.nn.functional as F

from k3 import envs
from k3.ops import kda_fla


def test_switch_parses_on_by_default():
    assert envs.parse({}).fla_keep_forward
    assert not envs.parse({"K3_FLA_KEEP_FORWARD": "0"}).fla_keep_forward
    assert envs.parse({"K3_FLA_KEEP_FORWARD": "1"}).fla_keep_forward


@pytest.fixture
def recorded(stub_fla):
    """fla's public chunk_kda replaced by a recorder of its disable_recompute argument."""
    calls = []

    def chunk_kda(q, k, v, g, beta, **kw):
        calls.append(kw["disable_recompute"])
        return v * 1.0, None

    stub_fla(chunk_kda)
    return calls


@pytest.mark.parametrize("gated", [True, False])
def test_kept_only_when_switched_on_and_differentiated(recorded, gated):
    H, K, T = 2, 8, 5
    q, k, v, f = (torch.randn(1, T, H, K) for _ in range(4))
    beta = torch.rand(1, T, H)

    def call(requires_grad):
        leaf = v.clone().requires_grad_(requires_grad)
        if gated:
            return kda_fla.fla_kda_gated(q, k, leaf, f, beta, torch.zeros(H), torch.zeros(H * K), -5.0,
                                         recurrent=False)
        return kda_fla.fla_kda_chunk(q, k, leaf, -f.abs(), beta)

    # kda_bwd=fla: the stub fla has no backend registry for k3's backward kernels to join
    with envs.override(fla_keep_forward=True, fla_lean=False, kda_bwd="fla"):
        call(True)
        call(False)
        with torch.no_grad():
            call(True)
    with envs.override(fla_keep_forward=False, fla_lean=False, kda_bwd="fla"):
        call(True)
    assert recorded == [True, False, False, False]


# ---------------------------------------------------------------------------------------------- CUDA

def _fla_ok() -> bool:
    return torch.cuda.is_available() and kda_fla.fla_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(torch.cuda.is_available() and not _fla_ok() and not envs.current().require_fla,
                    reason="flash-linear-attention >= 0.6.0 not importable")
@pytest.mark.parametrize("B,T,H,seed", [(2, 257, 4, 0), (1, 130, 3, 1)])
def test_kept_forward_gradients_equal_recomputed_and_reference(B, T, H, seed):
    from k3.ops.kda import kda_chunk, kda_gate
    from k3.ops.kda_core import force_backend

    K = 128
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    inputs = [r(B, T, H, K).bfloat16() for _ in range(4)] + [r(B, T, H).bfloat16(), r(H) * 0.5, r(H * K)]
    do = r(B, T, H, K)

    def run(keep):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with envs.override(fla_keep_forward=keep):
            o, _ = kda_fla.fla_kda_gated(*leaves, -5.0, recurrent=False)
        (o.float() * do).sum().backward()
        return [o] + [t.grad for t in leaves]

    def reference():
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        q, k, v, f, b, A_log, dt_bias = leaves
        with force_backend("reference"):
            o, _ = kda_chunk(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v,
                             kda_gate(f, A_log, dt_bias, -5.0), torch.sigmoid(b))
        (o * do.double()).sum().backward()
        return [o] + [t.grad for t in leaves]

    def rel_err(a, b):
        a, b = a.detach().double(), b.detach().double()
        assert torch.isfinite(a).all()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    names = ("o", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias")
    kept, recomputed, ref = run(True), run(False), reference()
    for name, a, b, c in zip(names, kept, recomputed, ref):
        assert rel_err(a, b) < 1e-3, name  # same kernels, kept tensors: equal up to launch-order rounding
        assert rel_err(a, c) < 5e-2, name  # bf16 inputs, fp32 inside: both within bf16 reach of float64
