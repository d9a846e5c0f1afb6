"""The SASS of k3's MXFP4 expert kernels' main loop, counted without a GPU: each variant is compiled for sm_90
(Triton's own ptxas, 16-byte-aligned pointers as a real launch specialises them), disassembled with the
cuobjdump that ships with Triton, and the instructions of the loop (the longest backward branch) are counted by
opcode. Decode is bound by instruction issue, so this is the number the decode layout is about.

Run: python benchmarks/sass_mxfp4_loop.py [--candidates]   (needs triton; no CUDA device)
Rows: K3's expert shapes at the decode tile (16, 128, 128, 4 warps, 3 stages, weights as the right operand):
gate+up (GLU, two matrices, 256 weights a thread a K step) and down (128), released and decode layout.
--candidates: the T=1 candidates of the next sweep (decode layout; benchmarks/bench_mxfp4_gemm.py --sweep):
registers a thread (cuobjdump -res-usage; STACK > 0: spills), CTAs an SM those registers and the shared
memory allow, and the programs of one T=1 step (16 slots) against the 132 SMs' resident CTAs (waves):
a 128-register cap (maxnreg) and the down launch at BLOCK_N = 256 (the one-launch fused kernel of session 11
lost to the three launches on the H200 in session 18 and was removed).
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


SMS, SM_REGS, SM_SHARED, SM_WARPS = 132, 65536, 228 * 1024, 64  # the H200 (sm_90)


def launch_attrs(signature: dict, divisible=(), unaligned=()) -> dict:
    """The argument attributes a launch on torch's tensors gives a kernel (Triton's specialisation), for a static
    compile: every pointer 16-byte aligned (those named `unaligned` not: a column slice off a boundary), tuple
    members too, and the integers named in `divisible` multiples of 16."""
    attrs = {}
    for i, (name, kind) in enumerate(signature.items()):
        members = enumerate(kind) if isinstance(kind, (tuple, list)) else [(None, kind)]
        for j, t in members:
            if (t.startswith("*") and name not in unaligned) or (j is None and name in divisible):
                attrs[(i,) if j is None else (i, j)] = [["tt.divisibility", 16]]
    return attrs


def compile_kernel(fn=None, signature=None, options=None, divisible=(), **consts):
    """fn (default: the MXFP4 expert GEMM) for sm_90, specialised as a launch would (`launch_attrs`)."""
    fn, signature = fn or _mxfp4_triton._expert_gemm_kernel, signature or SIGNATURE
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in consts}}, constexprs=consts,
                    attrs=launch_attrs(signature, divisible))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3, **(options or {})})
    return kernel


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def compile_sass(**consts) -> str:
    return cuobjdump(compile_kernel(**consts).asm["cubin"], "-sass")


def resources(kernel) -> dict:
    """REG and STACK (spills) a thread (cuobjdump -res-usage), SHARED: the launch's shared memory (Triton's
    pipeline buffers included) in bytes."""
    text = cuobjdump(kernel.asm["cubin"], "-res-usage")
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK):(\d+)", text)}
    return {**found, "SHARED": kernel.metadata.shared}


def ctas_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident CTAs an SM by registers (allocated 256 a warp at a time), shared memory and warp slots."""
    warp_regs = -(-regs * 32 // 256) * 256
    return min(SM_REGS // (warp_regs * warps), SM_SHARED // max(shared, 1), SM_WARPS // warps)


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


# (name, gate+up (else down), tile, compile options): T=1 candidates, decode layout, K3's shapes
CANDIDATES = [
    ("gate+up (16,128,256) default", True, dict(BLOCK_N=128, BLOCK_K=256), {}),
    ("gate+up (16,128,128)", True, dict(BLOCK_N=128, BLOCK_K=128), {}),
    ("gate+up maxnreg 128", True, dict(BLOCK_N=128, BLOCK_K=128), {"maxnreg": 128}),
    ("down (16,128,256) default", False, dict(BLOCK_N=128, BLOCK_K=256), {}),
    ("down (16,128,128)", False, dict(BLOCK_N=128, BLOCK_K=128), {}),
    ("down BLOCK_N=256", False, dict(BLOCK_N=256, BLOCK_K=128), {}),
    ("down maxnreg 128", False, dict(BLOCK_N=128, BLOCK_K=128), {"maxnreg": 128}),
]


def candidates():
    L, I, slots = 3584, 3072, 16
    print("| candidate | REG | STACK (spill) | shared bytes | CTAs an SM | programs at T=1 | waves | longest loop | "
          "top opcodes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, glu, tile, options in CANDIDATES:
        n, k = (I, L) if glu else (L, I)
        kernel = compile_kernel(options=options, N=n, K=k, GLU=glu, DECODE_LAYOUT=True, BLOCK_M=16, EXACT=False,
                                W_LEFT=False, USE_ASM=True, SELECTED=True, BIAS_A=0, BIAS_B=0, **tile)
        programs = -(-n // tile["BLOCK_N"]) * slots
        res = resources(kernel)
        per_sm = ctas_per_sm(res["REG"], res["SHARED"], 4)
        mix = loop_mix(cuobjdump(kernel.asm["cubin"], "-sass"))
        top = ", ".join(f"{op} {c}" for op, c in mix.most_common(5))
        print(f"| {name} | {res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | "
              f"{programs / (SMS * per_sm):.2f} | {sum(mix.values())} | {top} |", flush=True)


if __name__ == "__main__":
    candidates() if "--candidates" in sys.argv[1:] else main()
