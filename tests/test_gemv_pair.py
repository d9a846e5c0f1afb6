"""Decode GEMV, two linears into one output (k3.ops.gemv.linear_pair, `k3::decode_gemv_pair`): the MoE's shared
experts' down projection with their SiTU-GLU plus the routed up projection with its RMSNorm, one grid over both K
segments, against float64 and against the plain two linears; the MoE layer takes it on one device and leaves a
replaced expert seam (expert parallelism) its overlap. Without CUDA under the Triton interpreter; skipped where
triton is not installed."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from k3.config import K3Config  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402
from k3.ops import _gemv_triton, gemv  # noqa: E402
from k3.ops.gemv import force_gemv, linear_pair, linear_pair_reference, use_gemv_pair  # noqa: E402
from k3.ops.situ import situ_glu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BETAS = (4.0, 25.0)


def fp64_pair(gate, up, wa, b, g, eps, wb):
    """SiTU-GLU(gate, up) rounded to gate's dtype (the kernel's h) @ wa + RMSNorm(b) @ wb, in float64; plain
    segments where up or g is None."""
    h = gate.double() if up is None else situ_glu(gate.double(), up.double(), *BETAS).to(gate.dtype).double()
    bd = b.double()
    if g is not None:
        bd = bd * torch.rsqrt(bd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    return h @ wa.double().t() + bd @ wb.double().t()


def inputs(M, N, KA, KB, dtype, seed, glu=True, norm=True):
    """gate and up as column slices of one fused row (row stride past KA, as the MoE's in_proj gives them), b
    not unit-scale (the rstd must matter)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dtype).to(DEVICE)  # noqa: E731
    fused = r(M, 2 * KA + 5, scale=3.0)
    gate, up = fused[:, :KA], (fused[:, KA + 5:] if glu else None)
    b = r(M, KB, scale=4.0)
    g = (r(KB).abs() + 0.5) if norm else None
    return gate, up, r(N, KA, scale=0.1), b, g, r(N, KB, scale=0.1)


# (M, N, KA, KB): small's shared down + routed up at 1 row ([1536, 1024] and [1536, 768], cut to 96 outputs for
# the interpreter's pace), odd widths, a segment narrower than one split, and tl.dot tiles at 8 and 13 rows
SHAPES = [(1, 96, 1024, 768), (1, 37, 129, 300), (3, 50, 513, 1100), (8, 45, 96, 200), (13, 30, 700, 65),
          (40, 70, 1024, 768)]


@pytest.mark.parametrize("M,N,KA,KB", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_equals_glu_down_plus_normed_up(M, N, KA, KB, dtype):
    gate, up, wa, b, g, wb = inputs(M, N, KA, KB, dtype, seed=M * 31 + N + KA + KB)
    want = fp64_pair(gate, up, wa, b, g, 1e-6, wb)
    with force_gemv(True):
        assert use_gemv_pair(gate, wa, b, wb, up, g)
        y = linear_pair(gate, wa, b, wb, up, BETAS, g, 1e-6)
    with force_gemv(False):
        assert not use_gemv_pair(gate, wa, b, wb, up, g)
        plain = linear_pair(gate, wa, b, wb, up, BETAS, g, 1e-6)
    ref = linear_pair_reference(gate, wa, b, wb, up, BETAS, g, 1e-6)
    assert y.dtype == dtype and y.shape == (M, N)
    scale = want.abs().max().item()
    # fp32: sums of K products; bf16: one rounding of the sum (the plain ops round h·Wa, the norm and the sum)
    tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -6 * scale)
    for got in (y, plain, ref):
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("glu,norm", [(False, True), (True, False), (False, False)])
def test_pair_without_a_prologue(glu, norm):
    """Either segment may come plain: the reduce kernel scales only the normed segment's splits, and none when
    there is no norm."""
    gate, up, wa, b, g, wb = inputs(2, 40, 300, 520, torch.float32, seed=5, glu=glu, norm=norm)
    want = fp64_pair(gate, up, wa, b, g, 1e-5, wb)
    with force_gemv(True):
        y = linear_pair(gate, wa, b, wb, up, BETAS, g, 1e-5)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_pair_plan_splits_where_either_linear_would():
    """Split (a reduce launch after) exactly where `plan` splits either linear alone, else one launch whose
    programs walk each segment whole; each segment's splits cover its K in whole tiles; the shapes above reach
    both forms. small's pair: unsplit at 1 and 4 rows (4 rows of W a program: 384 blocks, above the aim); a
    narrower output at 4 rows splits, its grid at least `plan`'s aim (two programs an SM)."""
    forms = set()
    for M, N, KA, KB in [*SHAPES, (1, 1536, 1024, 768), (4, 1536, 1024, 768), (4, 768, 1024, 768)]:
        p = _gemv_triton.pair_plan(M, N, KA, KB, torch.bfloat16, 132)
        alone = [_gemv_triton.plan(M, N, K, torch.bfloat16, 132)["split"] > 1 for K in (KA, KB)]
        assert p["split"] == any(alone)
        forms.add(p["split"])
        for K, name in ((KA, "a"), (KB, "b")):
            split, per = p[f"split_{name}"], p[f"k_per_split_{name}"]
            assert per % p["block_k"] == 0 and (split - 1) * per < K <= split * per
            assert split == 1 or p["split"]
    assert forms == {False, True}
    assert not any(_gemv_triton.pair_plan(M, 1536, 1024, 768, torch.bfloat16, 132)["split"] for M in (1, 4))
    p = _gemv_triton.pair_plan(4, 768, 1024, 768, torch.bfloat16, 132)
    assert p["split"] and p["n_blocks"] * (p["split_a"] + p["split_b"]) >= 2 * 132


def test_pairs_that_do_not_fit_are_refused():
    gate, up, wa, b, g, wb = inputs(2, 40, 64, 32, torch.float32, seed=6)
    with force_gemv(True):
        assert use_gemv_pair(gate, wa, b, wb, up, g)
        assert not use_gemv_pair(gate, wa, b[:1], wb, up, g)  # other rows
        assert not use_gemv_pair(gate, wa, b, wb[:39], up, g)  # other outputs
        assert not use_gemv_pair(gate, wa, b.double(), wb.double(), up, g.double())  # other dtypes
        assert not use_gemv_pair(gate, wa, b, wb, up, torch.ones(31, device=DEVICE))  # a norm of another width
        assert not use_gemv_pair(gate, wa, b, wb.requires_grad_(), up, g)  # a gradient wanted


def _moe(dtype):
    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    moe = LatentMoE(cfg).to(DEVICE, dtype).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
        moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
    return cfg, moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_runs_the_shared_down_and_routed_up_as_one_pair(dtype, monkeypatch):
    """A tiny LatentMoE at 1 and 3 decode rows with the GEMV forced on: one pair launch and no single GEMV of the
    two weights; the output equals the layer with the GEMV off (norm, GLU, two linears, the add)."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)  # fewer, larger programs: the interpreter's pace
    cfg, moe = _moe(dtype)
    pairs, singles = [], []
    launch, launch_pair = gemv._launch, gemv._launch_pair
    monkeypatch.setattr(gemv, "_launch", lambda *a: singles.append(a[1]) or launch(*a))
    monkeypatch.setattr(gemv, "_launch_pair", lambda *a: pairs.append(a) or launch_pair(*a))
    for rows in (1, 3):
        pairs.clear(), singles.clear()
        x = torch.randn(rows, 1, cfg.hidden_size, device=DEVICE, dtype=dtype)
        with torch.no_grad():
            with force_gemv(True):
                fused = moe(x)
            with force_gemv(False):
                plain = moe(x)
        assert len(pairs) == 1 and pairs[0][1] is moe.shared_experts.down_proj.weight
        assert not any(w is moe.routed_expert_up_proj.weight or w is moe.shared_experts.down_proj.weight
                       for w in singles)
        scale = plain.abs().max().item()
        tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -5 * scale)
        torch.testing.assert_close(fused.double(), plain.double(), **tol)


def test_a_replaced_expert_seam_keeps_its_overlap_and_no_pair(monkeypatch):
    """combine_experts replaced on the instance (expert parallelism's seam): the shared experts run as its
    `meanwhile`, the pair is not taken, and the output is the same."""
    monkeypatch.setitem(_gemv_triton.LAUNCH, "fma_block_n", 64)
    cfg, moe = _moe(torch.float32)
    x = torch.randn(2, 1, cfg.hidden_size, device=DEVICE)
    pairs, meanwhiles = [], []
    launch_pair = gemv._launch_pair
    monkeypatch.setattr(gemv, "_launch_pair", lambda *a: pairs.append(a) or launch_pair(*a))

    def seam(z, idx, w, meanwhile=None):
        meanwhiles.append(meanwhile)
        return LatentMoE.combine_experts(moe, z, idx, w, meanwhile)

    with torch.no_grad(), force_gemv(True):
        own = moe(x)
        assert len(pairs) == 1
        moe.combine_experts = seam
        replaced = moe(x)
    assert len(pairs) == 1 and len(meanwhiles) == 1 and meanwhiles[0] is not None
    torch.testing.assert_close(replaced, own, rtol=1e-5, atol=1e-5)


def test_pair_kernel_compiles_for_the_h200():
    """small's shared down [1536, 1024] with its GLU and routed up [1536, 768] with its norm at 1 bf16 row, and a
    narrower output (768) at 4 rows, compiled for sm_90 by ptxas (no GPU needed): the GLU's exps and the rstd (a
    sqrt) in the one launch, split or not (split: each block's last split, after its atomic ticket, scales the
    second segment's splits)."""
    from sm90_compile import ptx_for_sm90

    sig = {"a_ptr": "*bf16", "wa_ptr": "*bf16", "up_ptr": "*bf16", "beta_gate": "fp32", "beta_up": "fp32",
           "b_ptr": "*bf16", "wb_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32", "part_ptr": "*fp32",
           "tickets_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "KA": "i32", "KB": "i32", "splits_a": "i32",
           "stride_am": "i32", "stride_wan": "i32", "stride_um": "i32", "stride_bm": "i32", "stride_wbn": "i32",
           "stride_om": "i32"}
    for M, N in ((1, 1536), (4, 768)):  # unsplit, split
        p = _gemv_triton.pair_plan(M, N, 1024, 768, torch.bfloat16, 132)
        ptx = ptx_for_sm90("k3.ops._gemv_triton", "_gemv_pair_kernel", sig, num_warps=p["warps"], A_GLU=True,
                           B_NORM=True, GLU_EXACT=False, SPLIT=p["split"], USE_DOT=p["use_dot"], DOT_IN_FP32=False,
                           BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
                           K_SPLIT_A=p["k_per_split_a"], K_SPLIT_B=p["k_per_split_b"], NUM_STAGES=p["stages"],
                           NORM_K=1024, NORM_BLOCK=1024)
        assert "ex2.approx" in ptx and "st.global" in ptx and "sqrt" in ptx
        assert ("atom.global.gpu.acq_rel" in ptx) == bool(p["split"])
    assert {bool(_gemv_triton.pair_plan(M, N, 1024, 768, torch.bfloat16, 132)["split"])
            for M, N in ((1, 1536), (4, 768))} == {False, True}
