"""Registers and spills of the decode GEMV kernel (k3.ops._gemv_triton) compiled for sm_90 without a GPU
(Triton's own ptxas, as in benchmarks/sass_mxfp4_loop.py): for `small`'s decode linears at 1, 8 and 16 rows,
the launch `plan` picks (with the prologues and epilogues decode gives them: o_proj its output gate, the routed
up its norm and residual, the shared down its GLU; then those two as one pair grid at 1 and 4 rows), the
registers a thread and spill bytes (STACK), the shared memory of the pipelined loop, the CTAs an SM those allow,
the programs of the launch and the waves they make on 132 SMs, and the bytes of W each program has in flight a
loop step (what keeps HBM busy).

Run: python benchmarks/sass_gemv.py   (needs triton; no CUDA device)
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from sass_mxfp4_loop import SMS, compile_kernel, ctas_per_sm, resources  # noqa: E402

from k3.ops import _gemv_triton  # noqa: E402

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
             "part_ptr": "*fp32", "norm_w_ptr": "*bf16", "eps": "fp32", "up_ptr": "*bf16", "beta_gate": "fp32",
           "beta_up": "fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_wn": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_um": "i32"}
SHAPES = [("KDA input projections", 6284, 1536), ("o_proj", 1536, 1536), ("routed_expert_up_proj", 1536, 768),
          ("shared experts' down_proj", 1536, 1024),
          ("lm_head", 32768, 1536)]


def main():
    print("| linear | rows | form | tile (M, N, K) | stages | splits | REG | STACK | shared bytes | CTAs an SM | "
          "programs | waves | W bytes a step |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, N, K in SHAPES:
        for M in (1, 8, 16):
            p = _gemv_triton.plan(M, N, K, torch.bfloat16, SMS)
            kernel = compile_kernel(_gemv_triton._gemv_kernel, SIGNATURE, {"num_warps": p["warps"]},
                                    HAS_BIAS=False, HAS_RES=name == "routed_expert_up_proj",
                                    HAS_NORM=name == "routed_expert_up_proj", NORM_K=triton.cdiv(K, 1024) * 1024,
                                    NORM_BLOCK=1024, HAS_GLU=name == "shared experts' down_proj", GLU_EXACT=False,
                                    SPLIT=p["split"] > 1,
                                    USE_DOT=p["use_dot"], DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                                    BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"],
                                    NUM_STAGES=p["stages"], OUT_GATE=name == "o_proj")
            res = resources(kernel)
            per_sm = ctas_per_sm(res["REG"], res["SHARED"], p["warps"])
            programs = p["n_blocks"] * p["split"]
            print(f"| {name} [{N}, {K}] | {M} | {'dot' if p['use_dot'] else 'fma'} | "
                  f"({p['block_m']}, {p['block_n']}, {p['block_k']}) | {p['stages']} | {p['split']} | {res['REG']} | "
                  f"{res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | {programs / (SMS * per_sm):.2f} | "
                  f"{p['block_n'] * p['block_k'] * 2} |", flush=True)
    pair_signature = {"a_ptr": "*bf16", "wa_ptr": "*bf16", "up_ptr": "*bf16", "beta_gate": "fp32", "beta_up": "fp32",
                      "b_ptr": "*bf16", "wb_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32", "part_ptr": "*fp32",
                      "out_ptr": "*bf16", "M": "i32", "N": "i32", "KA": "i32", "KB": "i32", "splits_a": "i32",
                      "stride_am": "i32", "stride_wan": "i32", "stride_um": "i32", "stride_bm": "i32",
                      "stride_wbn": "i32", "stride_om": "i32"}
    for M in (1, 4):  # the MoE's shared down (GLU) + routed up (norm) as one two-segment grid
        p = _gemv_triton.pair_plan(M, 1536, 1024, 768, torch.bfloat16, SMS)
        kernel = compile_kernel(_gemv_triton._gemv_pair_kernel, pair_signature, {"num_warps": p["warps"]},
                                A_GLU=True, B_NORM=True, GLU_EXACT=False, SPLIT=p["split"], NORM_K=1024,
                                NORM_BLOCK=1024, USE_DOT=p["use_dot"], DOT_IN_FP32=False,
                                BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
                                K_SPLIT_A=p["k_per_split_a"], K_SPLIT_B=p["k_per_split_b"], NUM_STAGES=p["stages"])
        res = resources(kernel)
        per_sm = ctas_per_sm(res["REG"], res["SHARED"], p["warps"])
        programs = p["n_blocks"] * (p["split_a"] + p["split_b"] if p["split"] else 1)
        splits = f"{p['split_a']} + {p['split_b']} (+ reduce)" if p["split"] else "1 (both K whole)"
        print(f"| shared down + routed up [1536, 1024 + 768] | {M} | {'dot' if p['use_dot'] else 'fma'} pair | "
              f"({p['block_m']}, {p['block_n']}, {p['block_k']}) | {p['stages']} | {splits} | "
              f"{res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | "
              f"{programs / (SMS * per_sm):.2f} | {p['block_n'] * p['block_k'] * 2} |", flush=True)


if __name__ == "__main__":
    main()
