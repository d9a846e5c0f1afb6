"""Decode of the `small` preset on one GPU, bf16: eager steps vs one CUDA graph per step, against the roofline.

Batch 1, 8, 64 at context 4K and 32K, over a preallocated StaticCache (k3.model.cache). The cache is filled
by a real 16-token prefill, then its MLA latents up to the context length are set to random values and its
length moved there (decode speed does not depend on their values; a real 32K x 64 prefill would only cost
device time). Each timed step decodes one token per row at that context and advances the cache.
Rows: "eager" = the model's forward per step; "graph" = k3.model.cuda_graph.GraphedDecodeStep (the path
`generate` takes on CUDA); "graph+compile" = the same with the step compiled by torch.compile before capture
(--compile; a failure is recorded as a row and the run goes on); "graph+pdl" = the graph captured with K3_PDL's
programmatic dependent launch (--pdl, k3.ops._pdl_triton), "graph+pdl+gemv" = that with decode's GEMV also taken
for weights up to 10M elements (--pdl-gemv: k3.ops.gemv.WIN_WEIGHT_ELEMS raised, so the mixers' and MoEs' input
projections, cuBLAS's today, join the PDL chain; lm_head and the dense MLP's gate+up stay cuBLAS's), "graph+gemv"
that GEMV without PDL (--gemv), "graph+gemv≤N rows" that GEMV at batches up to N rows too (--gemv-rows N: its
32/64-row tiles, and the MoE's shared down + routed up as one launch), "graph+pdl-prefetch" PDL's launches
without its L2 prefetches (--pdl-no-prefetch, K3_NO_PDL_PREFETCH), "graph+MODULE:k=v" the graph captured with
that kernel module's LAUNCH entries changed (--launch, repeatable: launch candidates judged by the whole step).
Memory roofline per step = bytes that must be read: every dense weight once (embedding row only), the
routed experts the batch touches (expected distinct experts E·(1-(1-k/E)^B) per MoE layer), lm_head,
each KDA state and its q/k/v conv tails read and written (fp32), each MLA layer's cached latent+k_extra read
once. Fraction =
(bytes / copy bandwidth measured in the same run) / measured step time. Target (issue 6): batch-1 >= 60%.
Run: PYTHONPATH=src python benchmarks/bench_gpu_decode.py [--quick] [--compile] [--pdl] [--pdl-no-prefetch] [--gemv]
[--gemv-rows 64] [--pdl-gemv] [--gemv-weight N] [--win-rows N] [--fused-rows N] [--launch MODULE:k=v]
[--contexts 4096] [--batches 1,8]
"""
import argparse
import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import changed_launch, measure_ceilings, parse_launch, save, table, time_ms  # noqa: E402

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.cache import MLAState  # noqa: E402
from k3.model.cuda_graph import GraphedDecodeStep  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.ops import gemv  # noqa: E402

REPS, WARMUP = 20, 3


def weight_bytes(model, cfg, batch) -> float:
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched = E * (1 - (1 - k / E) ** batch) / E
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        elif ".experts.w" in name:
            total += p.numel() * p.element_size() * touched
        else:
            total += p.numel() * p.element_size()
    return total


def filled_cache(model, cfg, B, ctx):
    """A StaticCache at length ctx−1 with room for every timed step."""
    cache = model.new_cache(B, ctx + 2 * (REPS + WARMUP) + 8)
    model(torch.randint(0, cfg.vocab_size, (B, 16), device="cuda"), cache=cache)
    for st in cache.layers:
        if isinstance(st, MLAState):
            st.latent[:, :ctx].normal_()
            st.k_extra[:, :ctx].normal_()
    cache.seq_len = ctx - 1
    cache.length.fill_(ctx - 1)
    return cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time the graph of a torch.compile'd step")
    ap.add_argument("--contexts", default="4096,32768", help="comma-separated context lengths")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--pdl", action="store_true", help="also time the graph captured with K3_PDL")
    ap.add_argument("--pdl-no-prefetch", action="store_true",
                    help="also time the graph captured with K3_PDL and K3_NO_PDL_PREFETCH")
    ap.add_argument("--gemv", action="store_true", help="also time it with decode's GEMV for the input projections")
    ap.add_argument("--gemv-rows", type=int, default=0, metavar="N",
                    help="also time it with decode's GEMV for the input projections at batches up to N rows (≤ 64)")
    ap.add_argument("--gemv-weight", type=int, action="append", default=[], metavar="N",
                    help="also time it with decode's GEMV taking weights of up to N elements (gemv.WIN_WEIGHT_ELEMS; "
                         "repeatable)")
    ap.add_argument("--win-rows", type=int, action="append", default=[], metavar="N",
                    help="also time it with decode's GEMV taking the plain linears up to N rows (gemv.WIN_ROWS; "
                         "repeatable)")
    ap.add_argument("--pdl-gemv", action="store_true", help="also time it with decode's GEMV for the input projections")
    ap.add_argument("--fused-rows", type=int, action="append", default=[], metavar="N",
                    help="also time it with decode's GEMV taking the linears with a prologue (norm, GLU, output gate; "
                         "the MoE's shared down + routed up pair) up to N rows (gemv.FUSED_WIN_ROWS; repeatable)")
    ap.add_argument("--launch", action="append", default=[], metavar="MODULE:k=v[,k=v]",
                    help="also time the graph captured with a kernel's LAUNCH changed (repeatable), e.g. "
                         "_moe_expert_major_triton:down_block_l=128: candidates judged by the step, in one run")
    ap.add_argument("--opt-in", default="", help="comma-separated opt-in kernel modules (k3.ops.triton_dispatch.OPT_IN, "
                    "e.g. _attn_res_route_triton): also time the graph with them on")
    a = ap.parse_args()
    if a.gemv_rows > gemv.MAX_ROWS:
        ap.error(f"--gemv-rows {a.gemv_rows}: the GEMV kernel runs at most {gemv.MAX_ROWS} rows")
    try:
        launches = [(spec, *parse_launch(spec)) for spec in a.launch]
    except (ImportError, ValueError) as e:
        ap.error(str(e))
    graphs = [("graph", contextlib.nullcontext)]
    if a.pdl:
        graphs.append(("graph+pdl", lambda: envs.override(pdl=True)))
    if a.pdl_no_prefetch:
        graphs.append(("graph+pdl-prefetch", lambda: envs.override(pdl=True, no_pdl_prefetch=True)))
    if a.gemv:
        graphs.append(("graph+gemv", lambda: _gemv_rule(WIN_WEIGHT_ELEMS=10_000_000)))
    if a.gemv_rows:
        graphs.append((f"graph+gemv≤{a.gemv_rows} rows",
                       lambda: _gemv_rule(WIN_WEIGHT_ELEMS=10_000_000, WIN_ROWS=a.gemv_rows)))
    if a.pdl_gemv:
        graphs.append(("graph+pdl+gemv",
                       lambda: _both(envs.override(pdl=True), _gemv_rule(WIN_WEIGHT_ELEMS=10_000_000))))
    for n in a.gemv_weight:
        graphs.append((f"graph+gemv weight≤{n:,}", lambda n=n: _gemv_rule(WIN_WEIGHT_ELEMS=n)))
    for n in a.win_rows:
        graphs.append((f"graph+plain gemv≤{n} rows", lambda n=n: _gemv_rule(WIN_ROWS=n)))
    for n in a.fused_rows:
        graphs.append((f"graph+fused≤{n} rows", lambda n=n: _gemv_rule(FUSED_WIN_ROWS=n)))
    if a.opt_in:
        names = tuple(a.opt_in.split(","))
        graphs.append((f"graph+{a.opt_in}", lambda: envs.override(triton_opt_in=names)))
    for spec, launch, change in launches:  # (bound now: a lambda in the loop would see the last one)
        graphs.append((f"graph+{spec}", lambda launch=launch, change=change: changed_launch(launch, change)))
    ceil = measure_ceilings()
    copy_bw = ceil["copy_TBps"] * 1e12
    print(ceil, flush=True)
    cfg = K3Config.preset("small" if not a.quick else "tiny")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    R, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    la = cfg.linear_attn_config
    n_kda, n_mla = cfg.num_hidden_layers - len(cfg.mla_layer_ids), len(cfg.mla_layer_ids)
    rows = []
    for ctx in ([int(c) for c in a.contexts.split(",")] if not a.quick else [512]):
        for B in ([int(b) for b in a.batches.split(",")] if not a.quick else [1, 4]):
            tails = 3 * (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim  # q, k, v conv tails
            state_bytes = n_kda * B * (la.num_heads * la.head_dim ** 2 + tails) * 4 * 2
            kv_bytes = n_mla * B * ctx * (R + rope) * 2
            nbytes = weight_bytes(model, cfg, B) + state_bytes + kv_bytes
            floor_ms = nbytes / copy_bw * 1e3
            tok = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
            with torch.no_grad():
                cache = filled_cache(model, cfg, B, ctx)
                eager_ms = time_ms(lambda: model(tok, cache=cache), warmup=WARMUP, reps=REPS)
                timings = [("eager", eager_ms)]
                for mode, switches in graphs:  # (captured under the switches: the launches stay in the graph)
                    cache = graphed = None
                    cache = filled_cache(model, cfg, B, ctx)
                    with switches():
                        graphed = GraphedDecodeStep(model, cache)
                    timings.append((mode, time_ms(lambda: graphed.step(tok), warmup=WARMUP, reps=REPS)))
                if a.compile:
                    cache = graphed = None
                    cache = filled_cache(model, cfg, B, ctx)
                    try:
                        graphed = GraphedDecodeStep(model, cache, compile=True)
                        timings.append(("graph+compile", time_ms(lambda: graphed.step(tok), warmup=WARMUP, reps=REPS)))
                    except Exception as e:  # noqa: BLE001 - record why and keep the other rows
                        rows.append(dict(batch=B, context=ctx, mode=f"graph+compile failed: {type(e).__name__}: {e}"[:200]))
                        print(rows[-1], flush=True)
            for mode, ms in timings:
                rows.append(dict(batch=B, context=ctx, mode=mode, step_ms=ms, tokens_per_s=B / ms * 1e3,
                                 bytes_MB=nbytes / 1e6, floor_ms=floor_ms, roofline_frac=floor_ms / ms))
                print(rows[-1], flush=True)
            cache = graphed = None
            torch.cuda.empty_cache()
    print(table(rows, ["batch", "context", "mode", "step_ms", "tokens_per_s", "bytes_MB", "floor_ms", "roofline_frac"]))
    save("decode" + ("_quick" if a.quick else ""), {"rows": rows, "ceilings": ceil})


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def _gemv_rule(**values):
    """Decode's GEMV taken by `gemv.kernel_wins` with its constants (WIN_ROWS, WIN_WEIGHT_ELEMS, FUSED_WIN_ROWS)
    changed inside the block."""
    return mock.patch.multiple(gemv, **values)


if __name__ == "__main__":
    main()
