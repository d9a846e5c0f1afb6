"""Long-context prefill of the `small` preset on one GPU (bf16, batch 1): time and peak memory, 8K upward.

`k3.model.generate.chunked_prefill` into the model's cache, --chunk tokens at a time (one pass when the
prompt is shorter), the LM head on the last position only. Chunking bounds the activations by the chunk, so
memory grows only with the cache (MLA latents, 4 of 16 layers). Stops before a length whose predicted time
(quadratic extrapolation, pessimistic) exceeds --budget-s.
Target (issue 6): a 1M-token prefill completes on one H200, with a near-linear time curve.
Compute floor: (2 · N_active · T + Σ_MLA H · T² · (d_qk + d_v)) FLOP over the matmul rate measured in the same
run (N_active without the LM head, which sees one position; causal attention is half the T² square, 2 FLOP a
multiply-add; KDA's own arithmetic left out).
Run: PYTHONPATH=src python benchmarks/bench_gpu_prefill.py [--quick] [--budget-s 240] [--chunk 65536]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import active_params, measure_ceilings, save, table  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.model.generate import chunked_prefill  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--chunk", type=int, default=65536)
    a = ap.parse_args()
    cfg = K3Config.preset("small" if not a.quick else "tiny")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    lengths = [8192, 32768, 131072, 262144, 524288, 1048576] if not a.quick else [1024, 4096]
    rate = measure_ceilings()["matmul_TFLOPs"] * 1e12
    n_act = active_params(model, cfg, skip=("lm_head",))
    n_mla = len(cfg.linear_attn_config.full_attn_layers)
    attn_per_t2 = n_mla * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    rows, last = [], None
    for T in lengths:
        if last is not None:
            predicted = last[1] * (T / last[0]) ** 2  # pessimistic: as if all of it were quadratic
            if predicted > a.budget_s and T > 262144:
                rows.append(dict(tokens=T, status=f"skipped (predicted up to {predicted:.0f} s)"))
                print(rows[-1], flush=True)
                continue
        ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.no_grad():
                for rep in range(2 if T <= 131072 else 1):  # a warm-up at the small lengths
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    cache = model.new_cache()
                    logits = chunked_prefill(model, ids, cache, a.chunk if not a.quick else 1024)
                    torch.cuda.synchronize()
                    sec = time.perf_counter() - t0
            assert torch.isfinite(logits).all()
            floor_s = (2 * n_act * T + attn_per_t2 * T * T) / rate
            rows.append(dict(tokens=T, status="ok", seconds=sec, tokens_per_s=T / sec, floor_s=floor_s,
                             peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30, cache_GiB=cache.nbytes() / 2 ** 30))
            last = (T, sec)
        except torch.OutOfMemoryError:
            rows.append(dict(tokens=T, status="OOM", peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30))
        print(rows[-1], flush=True)
        cache = logits = None
    print(f"matmul rate {rate / 1e12:.0f} TFLOP/s, N_active {n_act / 1e6:.1f}M (without the LM head)")
    print(table(rows, ["tokens", "status", "seconds", "floor_s", "tokens_per_s", "peak_GiB", "cache_GiB"]))
    save("prefill" + ("_quick" if a.quick else ""), {"rows": rows})


if __name__ == "__main__":
    main()
