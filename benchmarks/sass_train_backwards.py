"""Registers and spills of the AttnRes mix backward (and its training forward's launch choices) and the short conv
backward (k3.ops._attn_res_triton, k3.ops._conv_triton) compiled for sm_90 without a GPU (Triton's own ptxas, as
benchmarks/sass_gemv.py): at `small`'s training shapes (bf16, D = C = 1536, the specialisations a training step
compiles: integer arguments divisible by 16): registers a thread, spill bytes (STACK), shared memory, the programs an
SM those allow (for the mix: and the count its launch asks for, BWD_PROGRAMS_PER_SM), and the bytes of loads each
program issues together (what keeps HBM busy: ~30 KB an SM in flight reach an H200's bandwidth), each kernel in 1
stage (a step's loads, then its math) and in its default (BWD_STAGES: the next step's loads in flight through this
step's math); the conv also at the UNROLL values bench_gpu_kernels.py --backwards times, and at its default with the
heads' L2 norm.

Run: python benchmarks/sass_train_backwards.py   (needs triton; no CUDA device)
"""
import os
import sys

import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import sass_mxfp4_loop  # noqa: E402
from sass_mxfp4_loop import ctas_per_sm, resources  # noqa: E402

from k3.ops import _attn_res_triton, _conv_triton  # noqa: E402

D = 1536
SPECIALISED_INTS = ("R", "D", "T", "C")  # 32768 rows, 1536 wide, 4096 tokens a row: divisible by 16


def compile_kernel(fn, signature: dict, num_warps: int, **consts):
    """fn for sm_90 with pointers (tuple members too) and SPECIALISED_INTS marked divisible by 16, as a launch
    at these shapes specialises them."""
    return sass_mxfp4_loop.compile_kernel(fn, signature, {"num_warps": num_warps}, divisible=SPECIALISED_INTS,
                                          **consts)


def mix_rows():
    for n in (2, 3, 4, 5):
        tuples = {"srcs": ("*bf16",) * n, "grads": ("*bf16",) * n, "addends": ("*bf16",) * n, "g_ptr": "*bf16",
                  "uw_ptr": "*fp32", "scores_ptr": "*fp32", "lse_ptr": "*fp32"}
        warps = _attn_res_triton.NUM_WARPS["bwd"]
        per_sm = _attn_res_triton.BWD_PROGRAMS_PER_SM[n]
        for stages, norm in ((1, False), (2, False), (2, True)):
            sig = {**tuples, "nw_ptr": "*bf16" if norm else "*fp32", "q_ptr": "*fp32", "R": "i32", "D": "i32",
                   "eps": "fp32", "norm_eps": "fp32", "iters": "i32", "accumulate": "i32"}
            new = compile_kernel(_attn_res_triton._mix_bwd_kernel, sig, warps, N=n, NORM=norm,
                                 BLOCK_D=triton.next_power_of_2(D), STAGES=stages)
            # a row of g, the sources and the addends (with 2 stages: the next row's, while this row's math runs)
            yield f"AttnRes mix bwd, {n} sources", (f"{stages} stage(s), asks {per_sm} an SM"
                                                    + (", the norm folded" if norm else "")), warps, new, \
                (1 + 2 * n) * D * 2


def mix_fwd_rows():
    """The training forward (the residual add and the norm folded, as 28 of small's 32 mixes run) under its launch
    choices (_attn_res_triton.LAUNCH): the default, the sources preloaded, and 1 or 4 rows a program."""
    for n in (2, 5):
        sig = {"srcs": ("*bf16",) * n, "uw_ptr": "*fp32", "out_ptr": "*bf16", "scores_ptr": "*fp32",
               "lse_ptr": "*fp32", "add_ptr": "*bf16", "sum_ptr": "*bf16", "nw_ptr": "*bf16", "R": "i32", "D": "i32",
               "eps": "fp32", "norm_eps": "fp32"}
        default_r = _attn_res_triton._blocks(D)[0]
        for preload, block_r in ((False, default_r), (True, default_r), (True, 1), (True, 4), (False, 1)):
            kernel = compile_kernel(_attn_res_triton._mix_fwd_kernel, sig, _attn_res_triton.NUM_WARPS["fwd"], N=n,
                                    STATS=True, ADD=True, NORM=True, BLOCK_R=block_r,
                                    BLOCK_D=triton.next_power_of_2(D), PDL=False, PRELOAD=preload)
            form = f"{block_r} row(s) a program, " + ("sources preloaded" if preload else "a source at a time")
            # a source's tile (the chain: the next source's load waits on this one's reductions), or all of them
            yield (f"AttnRes mix + add + norm fwd, {n} sources", form, _attn_res_triton.NUM_WARPS["fwd"], kernel,
                   (n if preload else 1) * block_r * D * 2)


def conv_rows():
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "tail_ptr": "*bf16", "doc_ptr": "*bf16", "gy_ptr": "*bf16",
           "gnt_ptr": "*bf16", "gx_ptr": "*bf16", "gw_part_ptr": "*fp32", "gw_batch_ptr": "*fp32",
           "gw_ptr": "*bf16", "count_ptr": "*i32", "gtail_ptr": "*bf16", "T": "i32", "C": "i32", "eps": "fp32"}
    flags = dict(W=4, HAS_TAIL=False, HAS_DOC=False, SILU=True, HAS_GY=True, HAS_GNT=False, NEED_GX=True,
                 NEED_GW=True, NEED_GTAIL=False)
    ct = _conv_triton
    default = (ct.BWD_UNROLL, ct.BWD_STAGES, ct.BWD_FINISH_GW, ct.BWD_CHANNELS_FIRST)
    forms = sorted({default, (ct.BWD_UNROLL, 3 - ct.BWD_STAGES, *default[2:]), (2, *default[1:]), (8, *default[1:]),
                    (*default[:2], not ct.BWD_FINISH_GW, ct.BWD_CHANNELS_FIRST),
                    (*default[:3], not ct.BWD_CHANNELS_FIRST)})
    # the default form also with the heads' L2 norm (KDA's q and k in training: heads of 128)
    for (unroll, stages, finish, channels_first), l2 in [(f, 0) for f in forms] + [(default, 128)]:
        kernel = compile_kernel(ct.short_conv_bwd_kernel, sig, ct.BWD_NUM_WARPS, **flags, L2_HEAD=l2,
                                CHUNK_T=ct.BWD_CHUNK_T, BLOCK_C=ct.BWD_BLOCK_C, UNROLL=unroll, STAGES=stages,
                                FINISH_GW=finish, CHANNELS_FIRST=channels_first, FINISH_ROWS=ct.GW_FINISH_ROWS)
        # UNROLL rows of x and dy (with 2 stages: the next step's, while this step's math runs)
        form = (f"UNROLL {unroll}, {stages} stage(s), weight grad finished by {'the kernel' if finish else 'torch'}"
                + (", channels first" if channels_first else "") + (" (default)" if (unroll, stages, finish,
                                                                                    channels_first) == default else ""))
        name = "short conv + SiLU" + (f" + L2 (heads of {l2})" if l2 else "") + " bwd"
        yield name, form, ct.BWD_NUM_WARPS, kernel, unroll * 2 * ct.BWD_BLOCK_C * 2


def main():
    print("| kernel | form | warps | REG | STACK | shared bytes | programs an SM | warps an SM | load bytes a "
          "program issues together | ... an SM |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (mix_rows(), mix_fwd_rows(), conv_rows()):
        for name, form, warps, kernel, load_bytes in rows:
            res = resources(kernel)
            per_sm = min(ctas_per_sm(res["REG"], res["SHARED"], warps), 32)  # (32 resident programs an SM at most)
            print(f"| {name} | {form} | {warps} | {res['REG']} | {res.get('STACK', 0)} | {res['SHARED']} | {per_sm} | "
                  f"{per_sm * warps} | {load_bytes} | {per_sm * load_bytes} |", flush=True)


if __name__ == "__main__":
    main()
