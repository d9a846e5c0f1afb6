"""Decode-time expert kernels skip the slots another expert-parallel rank holds (expert id < 0, what
k3.serve.expert_shard's masked path passes under a CUDA graph): the packed MXFP4 kernels (both layouts) and the
float selected-experts kernels give the reference's answer for the held slots, a zero for the others, and do no
GEMM work for them: a spy on the packed kernel's K-loop step (`_accumulate`, one call per weight tile read)
records which experts' tiles were read. On CUDA where there is one, else on the CPU under the Triton
interpreter; skipped where triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the import below
pytest.importorskip("triton")

from k3.ops import _moe_decode_triton, _mxfp4_triton  # noqa: E402
from k3.ops.moe_decode import selected_experts_situ_mlp_reference  # noqa: E402
from k3.ops.mx_experts import packed_expert_situ_mlp_reference  # noqa: E402
from test_mxfp4_layout import CONFIG, DEVICE, Experts, rel_err  # noqa: E402

IDX = [[3, -1], [-1, 2], [1, 3]]  # token 0's second choice and token 1's first are held by another rank


class TileSpy:
    """Wraps `_accumulate` (called once per weight tile and K step): the expert of every tile read."""

    def __init__(self, expert_bytes: int):
        self.expert_bytes = expert_bytes  # packed bytes of one expert's matrix (the stack's expert stride)
        self.experts: list[int] = []
        self.inner = _mxfp4_triton._accumulate

    def __call__(self, acc, w_p, w_s, w_off, *rest, **kw):
        # w_off = e · N · K/2 + n · K/2: the tile's expert from its smallest offset
        self.experts.append(int(w_off.handle.data.min()) // self.expert_bytes)  # the interpreter's numpy array
        return self.inner(acc, w_p, w_s, w_off, *rest, **kw)


@pytest.mark.parametrize("decode", [False, True])
def test_packed_selected_kernel_skips_other_ranks_slots(monkeypatch, decode):
    experts = Experts(4, 64, 96, 118, 124, seed=5)
    idx = torch.tensor(IDX, device=DEVICE)
    z = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    spy = TileSpy(96 * 64 // 2)  # gate, up [96, 64] and down [64, 96]: the same bytes an expert
    if DEVICE == "cpu":  # the interpreter calls the jitted helpers as Python; a compiled kernel has no seam
        monkeypatch.setattr(_mxfp4_triton, "_accumulate", spy)
    out = _mxfp4_triton.selected_situ_mlp(z, idx, *experts.weights(decode), 4.0, 25.0, config=CONFIG)
    held = [(n, j) for n in range(3) for j in range(2) if IDX[n][j] >= 0]
    for n, j in held:
        ref = packed_expert_situ_mlp_reference(z[n:n + 1].double(), torch.nn.functional.one_hot(idx[n, j], 4),
                                               experts)
        assert rel_err(out[2 * n + j:2 * n + j + 1], ref) < 1e-5, (n, j)
    for s in (1, 2):  # the skipped slots' rows are exact zeros (the routing weights' sum reads them)
        assert torch.equal(out[s], torch.zeros_like(out[s]))
    # every tile read belongs to a held slot's expert, and as many tiles as the held slots need, not all 6 slots'
    if DEVICE == "cuda":
        return
    block_n, block_k = CONFIG[1:3]
    per_slot = 2 * -(-96 // block_n) * -(-64 // block_k) + -(-64 // block_n) * -(-96 // block_k)  # gate+up, down
    assert len(spy.experts) == len(held) * per_slot
    assert sorted(set(spy.experts)) == sorted({IDX[n][j] for n, j in held})


def test_float_selected_kernels_skip_other_ranks_slots():
    g = torch.Generator().manual_seed(8)
    E, L, I = 4, 48, 40
    w1, w3, w2 = (torch.randn(E, *s, generator=g).to(DEVICE) / 8 for s in ((I, L), (I, L), (L, I)))
    z = torch.randn(3, L, generator=g).to(DEVICE)
    wt = torch.rand(3, 2, generator=g).to(DEVICE)
    idx = torch.tensor(IDX, device=DEVICE)
    out = _moe_decode_triton.selected_experts_situ_mlp(z, idx, wt, w1, w3, w2, 4.0, 25.0)
    # the held slots alone, by the reference with the others' weights zeroed and their ids replaced
    held = idx >= 0
    want = selected_experts_situ_mlp_reference(z.double(), torch.where(held, idx, 0), torch.where(held, wt, 0).double(),
                                               w1.double(), w3.double(), w2.double())
    assert rel_err(out, want) < 1e-5
    # the reference's own contract for ids < 0 is the same sum
    got = selected_experts_situ_mlp_reference(z.double(), idx, wt.double(), w1.double(), w3.double(), w2.double())
    assert torch.allclose(got, want)
    # poisoned weights past the stack (what id -1 would read as the last expert, or out of bounds) change nothing
    w1p, w3p, w2p = (w.clone() for w in (w1, w3, w2))
    for w in (w1p, w3p, w2p):
        w[-1] = float("nan")
    keep = torch.tensor([[0, -1], [-1, 2], [1, 0]], device=DEVICE)  # expert 3 (the last) never held
    out = _moe_decode_triton.selected_experts_situ_mlp(z, keep, wt, w1p, w3p, w2p, 4.0, 25.0)
    assert torch.isfinite(out).all()
