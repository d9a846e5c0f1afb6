"""Registers, spills and occupancy of KDA's chunk-backward stages compiled for sm_90 without a GPU (Triton's own
ptxas, as benchmarks/sass_train_backwards.py): fla 0.6's `chunk_kda_bwd_kernel_wy_dqkg_fused` at the choice k3's
autotune table pins on the H200 (BK 64, BV 64, 4 warps, 3 stages) against k3.ops._kda_bwd_triton's two kernels, and
fla's `chunk_kda_bwd_kernel_intra` (its pinned choice: 1 warp, 2 stages; BK 32, sub-chunks of 16, the safe gate)
against k3's `_intra_kernel`, at `small`'s training shapes (bf16, H 12, K = V = 128, chunk 64, 8 x 4096 tokens: 64
chunks a row), T specialised as the launch specialises it (4096: a multiple of 16; unspecialised, k3's
_dv_dA_kernel seemed to take 234 registers and 2 programs an SM instead of 168 and 3).
Columns: REG and STACK (spill bytes) a thread, shared memory a program, programs an SM those allow, the launch's
programs and waves over the 132 SMs, and the SASS's local-memory loads/stores (LDL/STL: the spills' traffic),
warpgroup MMAs (HGMMA) and warp MMAs (HMMA), exponentials and other special functions (MUFU), fp32 FMAs (FFMA),
shared-memory loads (LDS) and barriers (BAR), and all instructions (SASS; static counts: a loop's body once). The
intra rows: k3's default launch and the others bench_gpu_kernels.py --kda-bwd times (KDA_BWD_LAUNCH).

Run: python benchmarks/sass_kda_bwd.py   (needs triton; no CUDA device; fla from its wheel in .whl/ or installed)
"""
import collections
import glob
import math
import os
import re
import sys
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))
from sass_mxfp4_loop import SMS, ctas_per_sm, cuobjdump, launch_attrs, resources  # noqa: E402

from k3.ops import _kda_bwd_triton as k3_bwd  # noqa: E402

B, T, H, K, V, BT = 8, 4096, 12, 128, 128, 64
NT = T // BT


def fla_kernel(name: str = "chunk_bwd.chunk_kda_bwd_kernel_wy_dqkg_fused"):
    """fla's kernel (fla.ops.kda.<name>) as a JITFunction: fla installed, else its wheel in .whl/ imported in place
    (a zip on sys.path). fla's package __init__ imports einops, which only its other ops use: a stand-in is enough
    to compile."""
    try:
        import fla  # noqa: F401
    except ImportError:
        wheels = sorted(glob.glob(os.path.join(HERE, "..", ".whl", "fla_core-0.6.*.whl")))
        if not wheels:
            sys.exit("needs fla 0.6 (installed, or its wheel in .whl/)")
        sys.path.insert(0, wheels[-1])
        if "einops" not in sys.modules:
            try:
                import einops  # noqa: F401
            except ImportError:
                stand_in = types.ModuleType("einops")
                stand_in.__getattr__ = lambda name: None
                sys.modules["einops"] = stand_in
    import importlib

    module, _, kernel = name.rpartition(".")
    fn = getattr(importlib.import_module(f"fla.ops.kda.{module}"), kernel)
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # under its heuristics and autotuner
        fn = fn.fn
    return fn


def compile_kernel(fn, signature: dict, num_warps: int, num_stages: int = 3, maxnreg=None, **consts):
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in consts if k not in signature}},
                    constexprs=consts, attrs=launch_attrs(signature, divisible=("T",)))
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def rows():
    bf, f32 = "*bf16", "*fp32"
    fla_sig = dict(q=bf, k=bf, v=bf, v_new=bf, g=f32, beta=f32, A=bf, h=bf, do=bf, dh=bf, dq=f32, dk=f32, dv=bf,
                   dv2=bf, dg=f32, db=f32, dA=f32, cu_seqlens="constexpr", chunk_indices="constexpr", scale="fp32",
                   T="i32")
    yield ("fla chunk_kda_bwd_kernel_wy_dqkg_fused", "BK 64, BV 64, 3 stages", 4, (NT, B * H),
           compile_kernel(fla_kernel(), fla_sig, 4, cu_seqlens=None, chunk_indices=None, H=H, HV=H, K=K, V=V, BT=BT,
                          BK=64, BV=64, STATE_V_FIRST=False, IS_VARLEN=False, USE_GRAPH=False))
    import triton.language as tl

    sig = dict(q=bf, k=bf, v_new=bf, g=f32, beta=f32, A=bf, h=bf, do=bf, dh=bf, dv=bf, dq=f32, dk=f32, dg=f32,
               scale="fp32", T="i32")
    kb = k3_bwd
    bk, bv, w, st, cap = kb.DQKG_BK, kb.DQKG_BV, kb.DQKG_WARPS, kb.DQKG_STAGES, kb.DQKG_MAXNREG
    yield ("k3 _dqkg_kernel", f"BK {bk}, BV {bv}, {st} stages, cap {cap}", w, (K // bk, NT, B * H),
           compile_kernel(kb._dqkg_kernel, sig, w, st, cap, H=H, K=K, V=V, BT=BT, BK=bk, BV=bv, ACC=tl.float32))
    sig = dict(k=bf, v=bf, g=f32, beta=f32, A=bf, h=bf, dv=bf, dv2=bf, db=f32, dA=f32, T="i32")
    bv, w, st, cap = kb.DVA_BV, kb.DVA_WARPS, kb.DVA_STAGES, kb.DVA_MAXNREG
    yield ("k3 _dv_dA_kernel", f"BV {bv}, {st} stages, cap {cap}", w, (NT, B * H),
           compile_kernel(kb._dv_dA_kernel, sig, w, st, cap, H=H, K=K, V=V, BT=BT, BV=bv, ACC=tl.float32))
    sig = dict(q=bf, k=bf, g=f32, beta=f32, dAqk=f32, dAkk=f32, dq=f32, dq2=f32, dk=f32, dk2=f32, dg=f32, dg2=f32,
               db=f32, cu_seqlens="constexpr", chunk_indices="constexpr", B="i32", T="i32")
    yield ("fla chunk_kda_bwd_kernel_intra", "BK 32, BC 16, 2 stages", 1, (K // 32 * BT // 16 * NT, B * H),
           compile_kernel(fla_kernel("chunk_intra.chunk_kda_bwd_kernel_intra"), sig, 1, 2, cu_seqlens=None,
                          chunk_indices=None, H=H, HV=H, K=K, BT=BT, BC=16, BK=32, NC=BT // 16, IS_VARLEN=False,
                          SAFE_GATE=True, GATE_SHIFT=5.0 / math.log(2), USE_GATHER=True, USE_GRAPH=False))
    sig = dict(q=bf, k=bf, g=f32, beta=f32, dAqk=f32, dAkk=f32, dq=f32, dk=f32, dg=f32, dq2=f32, dk2=f32,
               db_part=f32, dg2=f32, T="i32")
    names, others = intra_launches()
    default = tuple(getattr(kb, n) for n in names)
    for values in [default] + [v for v in others if v != default]:
        c = dict(zip(names, values))
        form, bk, w, st, cap, bc = (c["INTRA_FORM"], c["INTRA_BK"], c["INTRA_WARPS"], c["INTRA_STAGES"],
                                    c["INTRA_MAXNREG"], kb.INTRA_BC)
        sub = form == "sub"
        fn, grid = (kb._intra_sub_kernel, (K // bk * BT // bc, NT, B * H)) if sub else \
            (kb._intra_kernel, (K // bk, NT, B * H))
        early = " early" * c["INTRA_EARLY"] if sub else ""
        yield (f"k3 {fn.__name__}" + " (default)" * (values == default),
               f"BK {bk}, BC {bc}, {st} stages, cap {cap}, diag {c['INTRA_DIAG']}{early}", w, grid,
               compile_kernel(fn, sig, w, st, cap, H=H, K=K, BT=BT, BC=bc, BK=bk, ACC=tl.float32,
                              DIAG_PRECISION=c["INTRA_DIAG"], **({"EARLY": c["INTRA_EARLY"]} if sub else {})))


def intra_launches():
    """(constant names, other values) of the intra kernel's launches bench_gpu_kernels.py --kda-bwd times."""
    sys.path.insert(0, HERE)
    from bench_gpu_kernels import KDA_BWD_LAUNCH

    return KDA_BWD_LAUNCH["intra"]


def main():
    print(f"sm_90, bf16, B {B} T {T} H {H} K {K} V {V} chunk {BT}")
    print("| kernel | tiles | warps | REG | STACK | shared bytes | programs an SM | programs | waves | LDL | STL "
          "| HGMMA | HMMA | MUFU | FFMA | LDS | BAR | SASS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tiles, warps, grid, kernel in rows():
        res = resources(kernel)
        per_sm = min(ctas_per_sm(res["REG"], res["SHARED"], warps), 32)
        programs = 1
        for n in grid:
            programs *= n
        ops = collections.Counter(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)",
                                             cuobjdump(kernel.asm["cubin"], "-sass"), re.M))
        print(f"| {name} | {tiles} | {warps} | {res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | "
              f"{programs} | {programs / (per_sm * SMS):.1f} | {ops['LDL']} | {ops['STL']} | {ops['HGMMA']} | "
              f"{ops['HMMA']} | {ops['MUFU']} | {ops['FFMA']} | {ops['LDS']} | {ops['BAR']} | {sum(ops.values())} |",
              flush=True)


if __name__ == "__main__":
    main()
