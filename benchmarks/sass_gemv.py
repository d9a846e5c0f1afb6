"""Registers and spills of the decode GEMV kernel (k3.ops._gemv_triton) compiled for sm_90 without a GPU
(Triton's own ptxas, as in benchmarks/sass_mxfp4_loop.py): for `small`'s decode linears at 1 to 64 rows (the
narrow forms to 16, the wide tiles past it), the launch `plan` picks, with the prologues and epilogues decode gives
them (o_proj its output gate, the routed up its norm and residual, the shared down its GLU; then those two as one
pair grid at 1 and 4 rows): the registers a thread and spill bytes (STACK), the shared memory of the pipelined
loop, the CTAs an SM those allow, the programs of the launch and the waves they make on 132 SMs, the bytes of W
each program reads a loop step, and what the whole launch keeps in flight (`in_flight`: what keeps HBM busy). The
integer arguments are specialised as a launch specialises them (multiples of 16): without that the loads are not
vectorised (2-byte scalar loads, no cp.async) and the registers and spills are not the launch's.

Run: python benchmarks/sass_gemv.py [--rows 1,8,16,32,64] [--launch wide_warps=8,wide_block_k=64]
     (needs triton; no CUDA device; --launch: entries of _gemv_triton.LAUNCH to compile with instead)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from sass_mxfp4_loop import SMS, compile_kernel, ctas_per_sm, resources  # noqa: E402

from k3.ops import _gemv_triton  # noqa: E402

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16",
             "part_ptr": "*fp32", "tickets_ptr": "*i32", "norm_w_ptr": "*bf16", "eps": "fp32", "up_ptr": "*bf16",
             "beta_gate": "fp32", "beta_up": "fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
             "stride_wn": "i32", "stride_rm": "i32", "stride_om": "i32", "stride_um": "i32"}
SHAPES = [("KDA input projections", 6288, 1536), ("o_proj", 1536, 1536), ("routed_expert_up_proj", 1536, 768),
          ("shared experts' down_proj", 1536, 1024),
          ("lm_head", 32768, 1536)]


def multiples_of_16(**values: int) -> list[str]:
    """The integer arguments a launch with these values specialises as multiples of 16 (Triton does so for every
    such int; its loads are then vectorised, which changes the registers)."""
    return [name for name, v in values.items() if v % 16 == 0]


def in_flight(p: dict, programs: int, per_sm: int, w_bytes: int) -> float:
    """MB of W the whole launch keeps in flight in its first wave: the programs resident at once, each with its
    loop's stages − 1 steps ahead. Little's law: at ~1 µs of HBM latency under load, ~3-5 MB keep an H100/H200
    busy; much less and the launch cannot reach the bandwidth whatever its code."""
    ahead = min(programs, SMS * per_sm) * p["block_n"] * p["block_k"] * 2 * max(1, p["stages"] - 1)
    return min(ahead, w_bytes) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64", help="x's rows: the narrow form to 16, the wide tiles past it")
    ap.add_argument("--launch", default="", help="LAUNCH entries to use instead, e.g. wide_warps=8,wide_block_k=64")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    for item in filter(None, args.launch.split(",")):
        key, value = item.split("=")
        if key not in _gemv_triton.LAUNCH:
            ap.error(f"--launch: no entry {key!r} in LAUNCH ({', '.join(_gemv_triton.LAUNCH)})")
        _gemv_triton.LAUNCH[key] = int(value)
    print("| linear | rows | form | tile (M, N, K) | stages | splits | REG | STACK | shared bytes | CTAs an SM | "
          "programs | waves | W bytes a step | W in flight (MB) |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, N, K in SHAPES:
        for M in rows:
            p = _gemv_triton.plan(M, N, K, torch.bfloat16, SMS)
            kernel = compile_kernel(_gemv_triton._gemv_kernel, SIGNATURE, {"num_warps": p["warps"]},
                                    divisible=multiples_of_16(M=M, N=N, K=K, stride_xm=K, stride_wn=K, stride_rm=N,
                                                              stride_om=N, stride_um=K),
                                    HAS_BIAS=False, HAS_RES=name == "routed_expert_up_proj",
                                    HAS_NORM=name == "routed_expert_up_proj", **_gemv_triton.norm_pass(K, p["block_m"]),
                                    HAS_GLU=name == "shared experts' down_proj", GLU_EXACT=False,
                                    SPLIT=p["split"] > 1,
                                    USE_DOT=p["use_dot"], DOT_IN_FP32=False, BLOCK_M=p["block_m"],
                                    BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], K_SPLIT=p["k_per_split"],
                                    NUM_STAGES=p["stages"], OUT_GATE=name == "o_proj")
            res = resources(kernel)
            per_sm = ctas_per_sm(res["REG"], res["SHARED"], p["warps"])
            programs = p["n_blocks"] * p["split"]
            print(f"| {name} [{N}, {K}] | {M} | {p['form']} | "
                  f"({p['block_m']}, {p['block_n']}, {p['block_k']}) | {p['stages']} | {p['split']} | {res['REG']} | "
                  f"{res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | {programs / (SMS * per_sm):.2f} | "
                  f"{p['block_n'] * p['block_k'] * 2} | {in_flight(p, programs, per_sm, N * K * 2):.1f} |",
                  flush=True)
    pair_signature = {"a_ptr": "*bf16", "wa_ptr": "*bf16", "up_ptr": "*bf16", "beta_gate": "fp32", "beta_up": "fp32",
                      "b_ptr": "*bf16", "wb_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32", "part_ptr": "*fp32",
                      "tickets_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "KA": "i32", "KB": "i32",
                      "splits_a": "i32",
                      "stride_am": "i32", "stride_wan": "i32", "stride_um": "i32", "stride_bm": "i32",
                      "stride_wbn": "i32", "stride_om": "i32"}
    for M in (1, 4):  # the MoE's shared down (GLU) + routed up (norm) as one two-segment grid
        p = _gemv_triton.pair_plan(M, 1536, 1024, 768, torch.bfloat16, SMS)
        kernel = compile_kernel(_gemv_triton._gemv_pair_kernel, pair_signature, {"num_warps": p["warps"]},
                                divisible=multiples_of_16(M=M, N=1536, KA=1024, KB=768, stride_am=1024,
                                                          stride_wan=1024, stride_um=1024, stride_bm=768,
                                                          stride_wbn=768, stride_om=1536),
                                A_GLU=True, B_NORM=True, GLU_EXACT=False, SPLIT=p["split"],
                                **_gemv_triton.norm_pass(768, p["block_m"]), USE_DOT=p["use_dot"], DOT_IN_FP32=False,
                                BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
                                K_SPLIT_A=p["k_per_split_a"], K_SPLIT_B=p["k_per_split_b"], NUM_STAGES=p["stages"])
        res = resources(kernel)
        per_sm = ctas_per_sm(res["REG"], res["SHARED"], p["warps"])
        programs = p["n_blocks"] * (p["split_a"] + p["split_b"] if p["split"] else 1)
        splits = f"{p['split_a']} + {p['split_b']} (+ reduce)" if p["split"] else "1 (both K whole)"
        print(f"| shared down + routed up [1536, 1024 + 768] | {M} | {p['form']} pair | "
              f"({p['block_m']}, {p['block_n']}, {p['block_k']}) | {p['stages']} | {splits} | "
              f"{res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | {programs} | "
              f"{programs / (SMS * per_sm):.2f} | {p['block_n'] * p['block_k'] * 2} | "
              f"{in_flight(p, programs, per_sm, 1536 * (1024 + 768) * 2):.1f} |", flush=True)


if __name__ == "__main__":
    main()
