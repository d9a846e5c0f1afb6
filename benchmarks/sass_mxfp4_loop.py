"""The SASS of k3's MXFP4 expert kernels' main loop, counted without a GPU: each variant is compiled for sm_90
(Triton's own ptxas, 16-byte-aligned pointers as a real launch specialises them), disassembled with the
cuobjdump that ships with Triton, and the instructions of the loop (the longest backward branch) are counted by
opcode. Decode is bound by instruction issue, so this is the number the decode layout is about.

Run: python benchmarks/sass_mxfp4_loop.py   (needs triton; no CUDA device)
Rows: K3's expert shapes at the decode tile (16, 128, 128, 4 warps, 3 stages, weights as the right operand):
gate+up (GLU, two matrices, 256 weights a thread a K step) and down (128), released and decode layout.
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from k3.ops import _mxfp4_triton  # noqa: E402

SIGNATURE = {"x_ptr": "*bf16", "wa_p": "*u8", "wa_s": "*u8", "wb_p": "*u8", "wb_s": "*u8", "y_ptr": "*bf16",
             "sched_ptr": "*i32", "num_tiles_ptr": "*i32", "TOP_K": "i32", "beta_gate": "fp32", "beta_up": "fp32"}


def compile_sass(**consts) -> str:
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(SIGNATURE.values()) if t.startswith("*")}
    src = ASTSource(fn=_mxfp4_triton._expert_gemm_kernel, signature={**SIGNATURE, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout


def loop_mix(sass: str) -> collections.Counter:
    """Opcodes of the instructions between the target and the source of the longest backward branch."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            toks = m.group(2).split()
            ins.append((int(m.group(1), 16), toks[1] if toks[0].startswith("@") else toks[0], m.group(2)))
    loops = [(int(t.group(1), 16), a) for a, op, text in ins if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", text.split("BRA")[-1])] if t and int(t.group(1), 16) < a]
    start, end = max(loops, key=lambda lo: lo[1] - lo[0])
    return collections.Counter(op.split(".")[0] for a, op, _ in ins if start <= a <= end)


def main():
    tile = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, EXACT=False, W_LEFT=False, USE_ASM=True, SELECTED=True,
                BIAS_A=0, BIAS_B=0)
    print("| kernel | layout | weights a thread a K step | loop instructions | a weight | top opcodes |")
    print("|---|---|---:|---:|---:|---|")
    for name, glu, n, k in (("gate+up", True, 3072, 3584), ("down", False, 3584, 3072)):
        for decode in (False, True):
            mix = loop_mix(compile_sass(N=n, K=k, GLU=glu, DECODE_LAYOUT=decode, **tile))
            weights = (2 if glu else 1) * 128 * 128 // 128
            total = sum(mix.values())
            top = ", ".join(f"{op} {c}" for op, c in mix.most_common(6))
            print(f"| {name} | {'decode' if decode else 'released'} | {weights} | {total} | {total / weights:.2f} | "
                  f"{top} |", flush=True)


if __name__ == "__main__":
    main()
