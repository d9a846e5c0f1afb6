"""Decode's routed experts slot by slot (k3.ops._moe_decode_triton: one gate+up program a slot and block of rows,
one down program a token summing its k choices) against `selected_experts_situ_mlp_reference` in float64: one and
two tokens (the batch sizes that take it), top-k 1..8, widths that are no multiple of the tiles and narrower than
one, a token that picks one expert twice, bf16 weights. On CUDA where there is one, else on the CPU under the
Triton interpreter; skipped where triton is not installed. (Slots held by another rank: test_expert_skip_triton.)"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from k3.ops import _moe_decode_triton as kernels  # noqa: E402
from k3.ops.moe_decode import selected_experts_situ_mlp_reference  # noqa: E402
from test_moe_expert_major_triton import DEVICE, case, rel_err  # noqa: E402


@pytest.mark.parametrize("N,k,E,L,I", [
    (1, 8, 64, 96, 64),  # small's top-8 of 64 (narrower rows)
    (2, 3, 8, 300, 40),  # L past one 256-wide step and no multiple of it
    (1, 1, 4, 24, 700),  # top-1; I past one 512-wide block of the down kernel
    (2, 5, 16, 50, 3),  # I narrower than one row block
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_slot_major_kernel_equals_the_reference(N, k, E, L, I, dtype, tol):
    z, idx, wt, w1, w3, w2 = (t.to(dtype) if t.is_floating_point() else t for t in case(N, k, E, L, I, seed=N + 7 * k))
    out = kernels.selected_experts_situ_mlp(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0)
    want = selected_experts_situ_mlp_reference(*(t.double() if t.is_floating_point() else t
                                                 for t in (z, idx, wt, w1, w3, w2)))
    assert out.shape == (N, L) and out.dtype == dtype
    assert rel_err(out, want) < tol


def test_a_token_may_pick_one_expert_twice():
    """Both slots count (the down program sums its k choices, not its distinct experts)."""
    z, idx, wt, w1, w3, w2 = case(2, 3, 6, 40, 24, seed=3, idx=torch.tensor([[2, 2, 5], [0, 1, 0]]))
    out = kernels.selected_experts_situ_mlp(*(t.to(DEVICE) for t in (z, idx, wt, w1, w3, w2)), 4.0, 25.0)
    want = selected_experts_situ_mlp_reference(*(t.double() if t.is_floating_point() else t
                                                 for t in (z, idx, wt, w1, w3, w2)))
    once = selected_experts_situ_mlp_reference(z.double(), idx[:, 1:], wt[:, 1:].double(), w1.double(), w3.double(),
                                               w2.double())
    assert rel_err(out, want) < 1e-5 and rel_err(out, once) > 1e-2


@pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
def test_kernels_compile_for_the_h200_at_the_released_widths_without_spills(kernel):
    """Both kernels at the released model's expert widths (latent 3584, width 3072, top-16; bf16) compile for sm_90
    (ptxas, no GPU: tests/sm90_compile.py) at the launch `selected_experts_situ_mlp` takes, with no spills: their
    loops are 14 and 6 steps long there, and gate+up's unrolled whole spills 232 B a thread."""
    from sm90_compile import registers_for_sm90

    p, I, L = kernels.LAUNCH, 3072, 3584
    block_l, block_i = min(p["gate_up_block_l"], 4096), min(p["down_block_i"], 4096)
    if kernel == "_gate_up_kernel":
        sig = {"z_ptr": "*bf16", "idx_ptr": "*i64", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "h_ptr": "*bf16",
               "TOP_K": "i32", "beta_gate": "fp32", "beta_up": "fp32"}
        consts = dict(I=I, L=L, BLOCK_I=p["gate_up_block_i"], BLOCK_L=block_l, UNROLL=kernels._unroll(-(-L // block_l)),
                      EXACT=False)
    else:
        sig = {"h_ptr": "*bf16", "idx_ptr": "*i64", "wt_ptr": "*fp32", "w2_ptr": "*bf16", "out_ptr": "*bf16"}
        consts = dict(I=I, L=L, TOP_K=16, BLOCK_L=p["down_block_l"], BLOCK_I=block_i,
                      UNROLL=kernels._unroll(-(-I // block_i)))
    got = registers_for_sm90("k3.ops._moe_decode_triton", kernel, sig, num_warps=p["num_warps"],
                             divisible=("TOP_K",) if kernel == "_gate_up_kernel" else (), **consts)
    assert got["STACK"] == 0, got
