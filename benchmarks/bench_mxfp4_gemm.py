"""K3's routed experts from packed MXFP4 on one GPU: k3's Triton kernels (dequantised in registers) against the
peer, bf16 `torch._grouped_mm` on the same weights dequantised ahead of time, and the byte roofline.

Shapes: K3's released experts (latent 3584, expert intermediate 3072, 896 experts, top-16), all 896 packed on
the card (15.7 GB: packed bytes and E8M0 scales of w1, w3, w2), each token routed to 16 distinct random experts.
* decode: 1, 8, 64 tokens. "selected" = the decode kernels (each (token, choice) reads its expert in place,
  no sort; what the model takes while N·k <= E/4), "grouped" = the grouped kernels on rows sorted by expert;
  "(decode layout)" = the same kernels on the bytes rearranged once at load (k3.ops.mxfp4_layout: one rotate and
  one mask a bf16 pair instead of two shifts, two masks and an or; one multiply a pair instead of two).
  Roofline = packed bytes of the experts the step touches (w1, w3, w2 and their scales) / bandwidth, both the
  H200's 4.8 TB/s datasheet figure and the copy bandwidth measured in this run (bytes read + written).
* prefill: 2048 and 8192 tokens (32K and 128K rows); TFLOP/s = 2·rows·3·L·I / time, against the bf16 matmul
  rate measured in this run.
The peer reads bf16 weights (4× the bytes) and is timed on the same routing; "peer+dequant" (decode) adds the
dequantisation of the touched experts that a bf16 path needs each step.
--sweep: also time other tile configurations of the kernels on the decode layout at decode T=1 and 8 (selected), T=64
(grouped) and prefill T=8192 (not with --sweep-decode-only), to choose `tile_config`'s defaults: (BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages, W_LEFT[, maxnreg]) (W_LEFT: the weight tile as the dot's left operand, else the right one;
maxnreg: a register cap), or a pair of them (the gate-and-up launch, the down launch); every T=1 row also replayed
from a CUDA graph with the weighted sum. (A one-launch fused kernel, the down GEMM split along I into the gate-and-up
programs, lost to the three graphed launches in session 18, 0.147 against 0.137 ms, and was removed in session 28.)
Run: PYTHONPATH=src python benchmarks/bench_mxfp4_gemm.py [--quick] [--sweep [--sweep-decode-only] [--sweep-only]]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import measure_ceilings, save, table, time_ms  # noqa: E402

from k3.ops.grouped_mm import expert_situ_mlp_grouped  # noqa: E402
from k3.ops.mx import mxfp4_unpack  # noqa: E402
from k3.ops.mx_experts import EXPERT_ORDER, packed_expert_situ_mlp, packed_selected_experts_situ_mlp  # noqa: E402
from k3.ops.mxfp4_layout import decode_layout_weight  # noqa: E402
from k3.ops.triton_dispatch import triton_module  # noqa: E402

H200_TBPS = 4.8


class Packed(torch.nn.Module):
    def __init__(self, E, L, I):
        super().__init__()
        for name, (out, inp) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
            self.register_buffer(f"{name}_packed", torch.randint(0, 256, (E, out, inp // 2), device="cuda",
                                                                 dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.randint(118, 122, (E, out, inp // 32), device="cuda",
                                                                dtype=torch.uint8))
        self.packed = True

    def dense(self, name, experts=None, chunk=32):
        p, s = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        if experts is not None:
            return mxfp4_unpack(p[experts], s[experts], torch.bfloat16)
        out = torch.empty(*p.shape[:-1], p.shape[-1] * 2, device="cuda", dtype=torch.bfloat16)
        for a in range(0, p.shape[0], chunk):
            out[a:a + chunk] = mxfp4_unpack(p[a:a + chunk], s[a:a + chunk], torch.bfloat16)
        return out


def routing(T, E, k, gen):
    idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.long, device="cuda").scatter_add_(0, flat, torch.ones_like(flat))
    return idx, counts, order


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="64 experts of a quarter the width (a smoke run)")
    ap.add_argument("--sweep", action="store_true", help="time other tile configurations too (decode layout)")
    ap.add_argument("--sweep-decode-only", action="store_true", help="sweep the decode shapes only (not prefill)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (no main table, no bf16 peer copy)")
    a = ap.parse_args()
    E, L, I, k = (64, 896, 768, 16) if a.quick else (896, 3584, 3072, 16)
    ceil = measure_ceilings()
    bw = ceil["copy_TBps"] * 1e12
    print(f"copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    experts = Packed(E, L, I)
    per_expert = sum(getattr(experts, f"{n}_{p}")[0].numel() for n in ("w1", "w3", "w2") for p in ("packed", "scale"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    mod = triton_module("_mxfp4_triton")
    released = [(getattr(experts, f"{n}_packed"), getattr(experts, f"{n}_scale")) for n in EXPERT_ORDER]
    decode = [decode_layout_weight(*w) for w in released]  # what a serving load does once
    with torch.no_grad():
        main_table = not (a.sweep and a.sweep_only)
        # the peer's bf16 weights (4× the bytes)
        dense = {n: experts.dense(n) for n in ("w1", "w3", "w2")} if main_table else None
        for T in (1, 8, 64) if main_table else ():
            idx, counts, order = routing(T, E, k, gen)
            z = torch.randn(T, L, device="cuda", dtype=torch.bfloat16)
            x = z.repeat_interleave(k, 0)[order]
            wt = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
            touched = int((counts > 0).sum())
            floor_ms = touched * per_expert / bw * 1e3
            floor_ds_ms = touched * per_expert / (H200_TBPS * 1e12) * 1e3
            used = torch.nonzero(counts).flatten()

            def peer_dequant():
                for n in ("w1", "w3", "w2"):
                    for part in used.split(32):  # in pieces: float32 temporaries of 600 experts would not fit
                        dense[n][part] = experts.dense(n, part)
                return expert_situ_mlp_grouped(x, counts, dense["w1"], dense["w3"], dense["w2"])
            times = {
                "grouped": time_ms(lambda: packed_expert_situ_mlp(x, counts, experts), reps=20, inner=5),
                "grouped (decode layout)": time_ms(lambda: mod.grouped_situ_mlp(x, counts, *decode, 4.0, 25.0),
                                                   reps=20, inner=5),
                "peer": time_ms(lambda: expert_situ_mlp_grouped(x, counts, dense["w1"], dense["w3"], dense["w2"]),
                                reps=20, inner=5),
                "peer+dequant": time_ms(peer_dequant, reps=10),
            }
            if T * k <= E // 4:
                times["selected"] = time_ms(lambda: packed_selected_experts_situ_mlp(z, idx, wt, experts),
                                            reps=20, inner=5)

                def selected_decode_layout():  # packed_selected_experts_situ_mlp's work on the decode layout
                    y = mod.selected_situ_mlp(z, idx, *decode, 4.0, 25.0)
                    return torch.bmm(wt.unsqueeze(1), y.view(T, k, -1)).squeeze(1)
                times["selected (decode layout)"] = time_ms(selected_decode_layout, reps=20, inner=5)
                # as the model runs it, in a CUDA graph: the gap to the row above is the host's launch cost
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    selected_decode_layout()
                times["selected (decode layout, graphed)"] = time_ms(graph.replay, reps=20, inner=5)
            for name, ms in times.items():
                rows.append({"case": f"decode T={T}", "path": name, "experts read": touched, "ms": ms,
                             "floor ms (copy bw)": floor_ms, "% of copy-bw floor": 100 * floor_ms / ms,
                             "% of 4.8 TB/s": 100 * floor_ds_ms / ms, "TB/s (packed)": touched * per_expert / ms / 1e9})
            print(table(rows[-len(times):], list(rows[-1])), flush=True)
        for T in ((512,) if a.quick else (2048, 8192)) if main_table else ():
            idx, counts, order = routing(T, E, k, gen)
            x = torch.randn(T * k, L, device="cuda", dtype=torch.bfloat16)
            flops = 2 * T * k * 3 * L * I
            for name, fn in (("grouped", lambda: packed_expert_situ_mlp(x, counts, experts)),
                             ("grouped (decode layout)", lambda: mod.grouped_situ_mlp(x, counts, *decode, 4.0, 25.0)),
                             ("peer", lambda: expert_situ_mlp_grouped(x, counts, dense["w1"], dense["w3"],
                                                                      dense["w2"]))):
                ms = time_ms(fn, reps=10)
                rows.append({"case": f"prefill T={T}", "path": name, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                             "% of matmul": 100 * flops / ms / 1e9 / ceil["matmul_TFLOPs"]})
            print(table(rows[-3:], list(rows[-1])), flush=True)
    if a.sweep:
        sweep(decode, E, L, k, gen, per_expert, bw, a.sweep_decode_only)
    cols = ["case", "path", "experts read", "ms", "floor ms (copy bw)", "% of copy-bw floor", "% of 4.8 TB/s",
            "TB/s (packed)", "TFLOP/s", "% of matmul"]
    print(table(rows, cols))
    save("bench_mxfp4_gemm", {"shape": {"E": E, "L": L, "I": I, "k": k}, "ceilings": ceil, "rows": rows})


# the grouped default first, the selected one fourth (`tile_config` at K3's widths: 256-wide K since session 30, its
# gate+up holding 255 registers and spilling 16 bytes on sm_90; the selected launch's 64-wide N since session 32);
# the pairs tell which launch gains from 256 (a pair = gate+up, down); 8 warps halve the registers a thread
DECODE_CONFIGS = [(16, 128, 256, 4, 3, False), (16, 128, 128, 4, 3, False), (16, 128, 256, 8, 3, False),
                  (16, 64, 256, 4, 3, False), (16, 32, 256, 4, 3, False), (16, 64, 256, 2, 3, False),
                  ((16, 128, 256, 4, 3, False), (16, 128, 128, 4, 3, False)),
                  ((16, 128, 128, 4, 3, False), (16, 128, 256, 4, 3, False)), (16, 128, 256, 4, 4, False)]
PREFILL_CONFIGS = [(64, 128, 64, 4, 4, True), (64, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False),
                   (128, 128, 64, 4, 3, False), (64, 256, 64, 8, 3, False), (128, 256, 64, 8, 3, False)]


def graphed_ms(fn) -> float:
    """fn replayed from a CUDA graph (as the model's decode steps run), after one eager warm-up call."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, reps=20, inner=5)


def sweep(w, E, L, k, gen, per_expert, bw, decode_only):
    """w: the (w1, w3, w2) weights to time, here in the decode layout. T=1 rows also time the whole expert step
    (the weighted sum included) replayed from a CUDA graph, as the model runs it: "graphed ms", "% of 4.8 TB/s"."""
    mod = triton_module("_mxfp4_triton")
    rows = []
    cases = [(1, "selected", DECODE_CONFIGS), (8, "selected", DECODE_CONFIGS), (64, "grouped", DECODE_CONFIGS)]
    if not decode_only:
        cases.append((8192, "grouped", PREFILL_CONFIGS))
    with torch.no_grad():
        for T, kind, configs in cases:
            idx, counts, order = routing(T, E, k, gen)
            z = torch.randn(T, L, device="cuda", dtype=torch.bfloat16)
            wt = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
            x = z.repeat_interleave(k, 0)[order]
            touched = int((counts > 0).sum())
            for cfg in configs:
                step = None  # the whole expert step (weighted sum included), for the graphed column
                if kind == "selected":
                    fn = lambda: mod.selected_situ_mlp(z, idx, *w, 4.0, 25.0, config=cfg)  # noqa: E731
                    step = lambda: torch.bmm(wt.unsqueeze(1), fn().view(T, k, -1))  # noqa: E731
                else:
                    fn = lambda: mod.grouped_situ_mlp(x, counts, *w, 4.0, 25.0, config=cfg)  # noqa: E731
                try:
                    ms = time_ms(fn, reps=10, inner=3 if T < 1000 else 1)
                    graphed = graphed_ms(step) if step is not None else None
                except Exception as exc:  # a configuration that does not compile or fit is a row, not a stop
                    rows.append({"case": f"T={T} {kind}", "config": str(cfg), "error": str(exc)[:80]})
                    continue
                flops = 2 * T * k * 3 * L * w[0][0].shape[1]
                rows.append({"case": f"T={T} {kind}", "config": str(cfg), "ms": ms, "graphed ms": graphed,
                             "% of copy-bw floor": 100 * touched * per_expert / bw * 1e3 / ms,
                             "% of 4.8 TB/s": (100 * touched * per_expert / (H200_TBPS * 1e12) * 1e3 / graphed
                                               if graphed else None),
                             "TFLOP/s": flops / ms / 1e9})
                rows[-1] = {c: v for c, v in rows[-1].items() if v is not None}
            print(table(rows, ["case", "config", "ms", "graphed ms", "% of copy-bw floor", "% of 4.8 TB/s", "TFLOP/s",
                               "error"]), flush=True)
            rows = []


if __name__ == "__main__":
    main()
