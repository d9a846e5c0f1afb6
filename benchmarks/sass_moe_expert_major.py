"""Registers and spills of the expert-major decode MoE kernels (k3.ops._moe_expert_major_triton) compiled for
sm_90 without a GPU (Triton's own ptxas, as benchmarks/sass_gemv.py does): at `small`'s widths (latent 768,
expert width 512, 64 experts, top-8), bf16, at batch 8, 64 and 128 (16, 16 and 32 slots a pass; down's 64, 128 and
128 rows of W2 a program), the launch shapes of `LAUNCH`: registers a thread, spill bytes (STACK), the shared
memory of the pipelined loop, the CTAs an SM those allow (the combine also as it takes the LatentMoE's routed norm and
shared SiTU-GLU: one program a token), the programs of the launch and the waves they make on 132
SMs (every expert's programs; an expert no slot chose ends after its scan), and the weight bytes each program reads
a loop step. The integer arguments are
specialised as a batch-64 launch specialises them (S = N·k, z's row stride and L multiples of 16).

Run: python benchmarks/sass_moe_expert_major.py   (needs triton; no CUDA device)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from sass_mxfp4_loop import SMS, compile_kernel, ctas_per_sm, resources  # noqa: E402

from k3.ops import _moe_expert_major_triton as kernels  # noqa: E402

E, L, I, TOP_K = 64, 768, 512, 8  # small
GATE_UP = {"z_ptr": "*bf16", "idx_ptr": "*i64", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "h_ptr": "*bf16", "S": "i32",
           "stride_z": "i32", "beta_gate": "fp32", "beta_up": "fp32"}
DOWN = {"h_ptr": "*bf16", "idx_ptr": "*i64", "w2_ptr": "*bf16", "y_ptr": "*fp32", "S": "i32"}
COMBINE = {"y_ptr": "*fp32", "idx_ptr": "*i64", "wt_ptr": "*fp32", "out_ptr": "*bf16", "E": "i32", "L": "i32",
           "nw_ptr": "*bf16", "eps": "fp32", "g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16", "stride_g": "i32",
           "stride_u": "i32", "beta_gate": "fp32", "beta_up": "fp32"}
I_SHARED = 1024  # small's shared experts' width (the combine's tail takes their SiTU-GLU)


def main():
    for batch in (8, 64, 128):  # 16 slots a pass, then 32 (kernels.block_m); 64 or 128 W2 rows (kernels.down_block_l)
        launches(batch)


def launches(batch: int):
    p = kernels.LAUNCH
    bm, rows_l = kernels.block_m(batch * TOP_K, E), kernels.down_block_l(batch * TOP_K, E)
    split = kernels.passes(batch * TOP_K, E)
    common = dict(BLOCK_M=bm, SCAN=p["scan"], STAGES=p["stages"], DOT_IN_FP32=False, PASSES=split)
    launches = [
        ("gate+up", kernels._gate_up_kernel, GATE_UP,
         dict(TOP_K=TOP_K, I=I, L=L, BLOCK_I=p["gate_up_block_i"], BLOCK_L=p["gate_up_block_l"], EXACT=False, **common),
         E * -(-I // p["gate_up_block_i"]) * split, 2 * p["gate_up_block_i"] * p["gate_up_block_l"] * 2),
        ("down", kernels._down_kernel, DOWN,
         dict(I=I, L=L, BLOCK_L=rows_l, BLOCK_I=p["down_block_i"], **common),
         E * -(-L // rows_l) * split, rows_l * p["down_block_i"] * 2),
        ("combine", kernels._combine_kernel, COMBINE, dict(TOP_K=TOP_K, BLOCK=p["combine_block"]),
         batch * -(-L // p["combine_block"]), 0),
        ("combine + norm + GLU", kernels._combine_kernel, COMBINE,
         dict(TOP_K=TOP_K, BLOCK=1024, NORM=True, GLU=True, I_SHARED=I_SHARED, BLOCK_G=1024), batch, 0),
    ]
    print(f"small: E={E}, L={L}, I={I}, top-{TOP_K}, bf16, batch {batch}: block_m={bm}, down rows {rows_l}, "
          f"stages={p['stages']}, warps={p['warps']}")
    print("| launch | REG | STACK | shared bytes | CTAs an SM | programs | waves | W bytes a step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, fn, signature, consts, programs, step_bytes in launches:
        warps = 4 if name.startswith("combine") else p["warps"]
        res = resources(compile_kernel(fn, signature, {"num_warps": warps}, divisible=("S", "stride_z", "L"),
                                       **consts))
        per_sm = ctas_per_sm(res["REG"], res["SHARED"], warps)
        print(f"| {name} | {res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | "
              f"{programs / (SMS * per_sm):.2f} | {step_bytes} |", flush=True)


if __name__ == "__main__":
    main()
