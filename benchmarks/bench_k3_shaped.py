"""The K3-shaped preset on one GPU with MXFP4 experts: decode at batch 1, 8, 64 and serving at 64 streams, each
against the byte roofline (issue 22, the one-GPU figures).

Model: `K3Config.preset("k3-shaped")`, the released widths (hidden 7168, 896 experts of 3584 -> 3072 at top-16,
KDA 96 x 128, MLA as released, vocabulary 163,840) in 4 layers (dense layer 0, 3 KDA + 1 MLA). Built on the meta
device, placed on the GPU empty, dense weights drawn there by the model's own init rule in bf16, routed experts
drawn in float32 a few experts at a time and packed to MXFP4 in place (k3.ops.mx.mxfp4_pack): 57.6 GB with all
896, with neither a bf16 copy of the experts (178 GB) nor a checkpoint on disk. `--experts N` for a smaller card.

Decode: a StaticCache filled much as in bench_gpu_decode.py (2 real decode steps, then the MLA latents up to
--context set to random values and the length moved there: a step's speed does not depend on their values, and
no prefill kernel needs compiling before the decode rows), then one token per row per step. "eager" = the
model's forward; "graph" = k3.model.cuda_graph.GraphedDecodeStep, the CUDA graph `generate` and the serving
runner replay.
Roofline per step = the bytes a step must read: every dense weight once (the embedding: one row per token), the
packed bytes (codes and E8M0 scales) of the experts the batch touches, expected E(1 - (1 - k/E)^B) distinct of E
at top-k for B tokens per MoE layer ("experts read"; beside it "experts routed", the distinct experts the random
model's router picked in one step, averaged over layers), each KDA state and its q/k/v conv tails read and
written (fp32), each MLA layer's cached latents of the context read once; over the copy bandwidth measured in this
run and over the H200's 4.8 TB/s datasheet figure. No peer runs here: no other engine serves this architecture
with MXFP4 experts.
Serving: k3's LLMEngine behind its HTTP server at --streams concurrent streams, loaded from a process of its own
(as `k3 bench serve`), beside the static graphed batch (`generate` over fixed batches) in the same process; the
roofline there is --streams tokens per decode-step floor at the mean context (prompt + half the output).
--decode-layout: the packed bytes rearranged once into the kernels' decode layout first (k3.ops.mx_experts.
use_decode_layout_, as a serving load on CUDA now does by default), to time it against the released layout; the
engine is told the same (EngineConfig.decode_layout), so without the flag every row is the released layout.
--quick: a shrunken k3-shaped model (width 256, 64 experts) on the CPU in float32, eager only: a smoke run of
every path and the arithmetic (tests/test_bench_k3_shaped.py); its times say nothing.
Run: PYTHONPATH=src python benchmarks/bench_k3_shaped.py [--experts N] [--quick] (results in $OUT/k3_shaped.json)
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import cpu_time_ms, measure_ceilings, save, table, time_ms  # noqa: E402

from k3.checkpoint.names import is_f32  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.cache import MLAState  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402
from k3.model.moe import Experts, LatentMoE, route  # noqa: E402
from k3.ops.mx import mxfp4_pack  # noqa: E402
from k3.ops.mx_experts import EXPERT_WEIGHTS, pack_experts_, use_decode_layout_  # noqa: E402

H200_TBPS = 4.8
REPS, WARMUP = 20, 3
PACK_CHUNK = 16  # experts drawn and packed at once: 0.7 GB of float32 at the released widths, a few GB of temporaries


def shaped_config(experts: int | None = None, quick: bool = False) -> K3Config:
    """The k3-shaped preset, with `experts` routed experts; quick: shrunk in width and experts (same layers, top-16,
    vocabulary and special ids) for a CPU smoke run."""
    cfg = K3Config.preset("k3-shaped")
    if quick:
        cfg = cfg.replace(hidden_size=256, intermediate_size=512, num_experts=64, moe_intermediate_size=96,
                          routed_expert_hidden_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                          kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, dtype="float32",
                          linear_attn_config={"num_heads": 4, "head_dim": 32})
    if experts is not None:
        if experts < cfg.num_experts_per_token:
            raise SystemExit(f"--experts {experts} is below the top-k of {cfg.num_experts_per_token}")
        cfg = cfg.replace(num_experts=experts)
    return cfg


@torch.no_grad()
def build_packed_model(cfg: K3Config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> K3ForCausalLM:
    """The model of `cfg` on `device` with random weights (the model's init rule) and MXFP4-packed routed experts,
    made in place: no float copy of all the experts ever exists."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for m in experts:
        pack_experts_(m, empty=True)
    for name, p in model.named_parameters():
        if not is_f32(name):  # the release keeps A_log, dt_bias, the router, ... in float32
            p.data = p.data.to(dtype)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.device(device):  # reset_parameters draws its tensors on the default device
        model.reset_parameters()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    std = cfg.initializer_range
    for m in experts:
        for name in EXPERT_WEIGHTS:
            packed, scale = getattr(m, f"{name}_packed"), getattr(m, f"{name}_scale")
            for a in range(0, packed.shape[0], PACK_CHUNK):
                n = min(PACK_CHUNK, packed.shape[0] - a)
                w = torch.randn(n, packed.shape[1], packed.shape[2] * 2, device=device) * std
                p, s = mxfp4_pack(w)
                packed[a:a + n].copy_(p)
                scale[a:a + n].copy_(s)
                del w, p, s
    return model.eval()


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts B tokens touch, each choosing k distinct of E uniformly at random: an expert is
    missed by one token with probability 1 - k/E, by all B independently with (1 - k/E)^B."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(model: K3ForCausalLM, cfg: K3Config, batch: int, context: int) -> dict:
    """Bytes one decode step of `batch` rows at `context` cached tokens must read, by part."""
    touched = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch) / cfg.num_experts
    parts = {"dense": 0.0, "experts": 0.0, "state": 0.0, "kv": 0.0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = t.numel() * t.element_size()
        if "embed_tokens" in name:
            parts["dense"] += batch * t.shape[1] * t.element_size()  # one row per token
        elif ".experts." in name:
            parts["experts"] += size * touched
        else:
            parts["dense"] += size
    la = cfg.linear_attn_config
    n_mla = len(cfg.mla_layer_ids)
    n_kda = cfg.num_hidden_layers - n_mla
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    parts["state"] = n_kda * batch * (H * K * K + 3 * (W - 1) * H * K) * 4 * 2  # fp32, read and written
    kv_size = model.model.embed_tokens.weight.element_size()  # MLA latents are cached in the model's dtype
    parts["kv"] = n_mla * batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_size
    parts["total"] = sum(parts.values())
    return parts


def weight_bytes(model: K3ForCausalLM) -> dict:
    """Bytes the model holds: routed experts (packed codes + scales) and everything else."""
    out = {"experts": 0, "dense": 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out["experts" if ".experts." in name else "dense"] += t.numel() * t.element_size()
    out["total"] = out["experts"] + out["dense"]
    return out


def routed_experts(model: K3ForCausalLM, step) -> float:
    """Distinct experts one call of step() routes to, averaged over the MoE layers (the routing recomputed from
    each layer's input by a hook): beside the expected count, to see how uniform the random model's routing is."""
    counts = []

    def count(moe, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        idx, _ = route(moe.router_scores(x), moe.gate.e_score_correction_bias, moe.top_k)
        counts.append(idx.unique().numel())
    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if isinstance(m, LatentMoE)]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return sum(counts) / len(counts)


def filled_cache(model: K3ForCausalLM, cfg: K3Config, batch: int, context: int, room: int):
    """A StaticCache at length context-1, `room` more steps free: 2 real decode steps (the decode kernels only: no
    prefill kernel to compile), then random MLA latents up to the context and the length moved there."""
    device = model.device
    cache = model.new_cache(batch, context + room)
    for _ in range(2):
        model(torch.randint(0, cfg.vocab_size, (batch, 1), device=device), cache=cache)
    for st in cache.layers:
        if isinstance(st, MLAState):
            st.latent[:, :context].normal_()
            st.k_extra[:, :context].normal_()
    cache.seq_len = context - 1
    cache.length.fill_(context - 1)
    return cache


def cpu_copy_tbps() -> float:
    x = torch.randn(2 ** 26)
    y = torch.empty_like(x)
    ms = cpu_time_ms(lambda: y.copy_(x), reps=5)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e12


def decode_rows(model, cfg, batches, context, copy_bw, cuda: bool) -> list[dict]:
    rows = []
    reps, warmup = (REPS, WARMUP) if cuda else (3, 1)
    room = 2 * (reps + warmup) + 8
    for B in batches:
        parts = step_bytes(model, cfg, B, context)
        floor_ms = parts["total"] / copy_bw * 1e3
        floor_ds_ms = parts["total"] / (H200_TBPS * 1e12) * 1e3
        tok = torch.randint(0, cfg.vocab_size, (B, 1), device=model.device)
        timings = []
        with torch.no_grad():
            cache = filled_cache(model, cfg, B, context, room)
            step = lambda: model(tok, cache=cache)  # noqa: E731
            timings.append(("eager", time_ms(step, warmup=warmup, reps=reps) if cuda else cpu_time_ms(step, warmup, reps)))
            routed = routed_experts(model, step)
            if cuda:
                from k3.model.cuda_graph import GraphedDecodeStep
                cache = None
                cache = filled_cache(model, cfg, B, context, room)
                try:
                    graphed = GraphedDecodeStep(model, cache)
                    timings.append(("graph", time_ms(lambda: graphed.step(tok), warmup=warmup, reps=reps)))
                except Exception as e:  # noqa: BLE001 - record why and keep the other rows
                    why = f"graph failed: {type(e).__name__}: {e}"[:200]
                    rows.append({"batch": B, "context": context, "mode": why})
                    print(rows[-1], flush=True)
                graphed = None
        for mode, ms in timings:
            rows.append({"batch": B, "context": context, "mode": mode, "step ms": ms, "tok/s": B / ms * 1e3,
                         "experts read": expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, B),
                         "experts routed": routed,
                         "GB read": parts["total"] / 1e9, "expert GB": parts["experts"] / 1e9,
                         "floor ms (copy bw)": floor_ms, "% of copy-bw floor": 100 * floor_ms / ms,
                         "% of 4.8 TB/s": 100 * floor_ds_ms / ms})
            print(rows[-1], flush=True)
        cache = None
        if cuda:
            torch.cuda.empty_cache()
    return rows


def serve_rows(model, cfg, a, copy_bw, on_row=lambda rows: None) -> tuple[list, dict]:
    """(the engine at a.streams streams and the static graphed batch, as `k3 bench serve` rows; the roofline).
    on_row(rows): after each row, so a run cut short keeps the rows it made."""
    from k3.data import Tokenizer
    from k3.serve import bench
    from k3.serve.engine import EngineConfig

    tokenizer = Tokenizer.from_file()
    engine_config = EngineConfig(memory_bytes=int(a.memory_gib * 2 ** 30), block_size=256, match_unit=16,
                                 max_batch_tokens=a.max_batch_tokens, max_num_seqs=a.streams,
                                 num_state_slots=2 * a.streams, decode_layout=a.decode_layout)
    n = a.waves * a.streams
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        print(f"serving: engine, a warm-up wave of {a.streams} then {n} requests ({a.input_len} tokens in, "
              f"{a.output_len} out)", flush=True)
        s = bench.run_engine(model, tokenizer, engine_config, "random", n, a.streams, None, a.input_len,
                             a.output_len, 1, a.seed, warmup=True,
                             on_start=lambda e: print(f"engine: {e.describe_capacity()}", flush=True))
        rows.append((f"engine c={a.streams}", s))
        on_row(rows)
        print(bench.format_table(rows[-1:]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        s = bench.static_batch_baseline(model, tokenizer, n, a.streams, a.input_len, a.output_len, a.seed,
                                        warmup=True)
        rows.append((f"static generate batch={a.streams}", s))
        on_row(rows)
        print(bench.format_table(rows[-1:]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    context = a.input_len + a.output_len // 2
    floor_ms = step_bytes(model, cfg, a.streams, context)["total"] / copy_bw * 1e3
    roof = {"streams": a.streams, "context": context, "step floor ms (copy bw)": floor_ms,
            "decode tok/s limit (copy bw)": a.streams / floor_ms * 1e3,
            "decode tok/s limit (4.8 TB/s)": a.streams * H200_TBPS * 1e12 / step_bytes(model, cfg, a.streams,
                                                                                    context)["total"]}
    for name, s in rows:
        roof[f"{name}: % of copy-bw limit"] = 100 * s["out_tok_per_s"] / roof["decode tok/s limit (copy bw)"]
    return rows, roof


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default: the released 896)")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per row at decode")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams served")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt length of a served request (words/tokens)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="timed requests per stream")
    ap.add_argument("--memory-gib", type=float, default=16.0, help="the engine's KV pool + KDA state budget")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--decode-layout", action="store_true",
                    help="rearrange the packed experts into the kernels' decode layout first (use_decode_layout_)")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a shrunken k3-shaped model on the CPU (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.context, a.streams, a.input_len, a.output_len, a.waves = min(a.context, 64), 4, 16, 4, 1
    cuda = not a.quick
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --quick for a CPU smoke run)")
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        ceil = measure_ceilings()
        torch.cuda.empty_cache()
    else:
        ceil = {"copy_TBps": cpu_copy_tbps()}
    copy_bw = ceil["copy_TBps"] * 1e12
    print(ceil, flush=True)
    cfg = shaped_config(a.experts, a.quick)
    t = time.perf_counter()
    model = build_packed_model(cfg, device, torch.bfloat16 if cuda else torch.float32, a.seed)
    wb = weight_bytes(model)
    if a.decode_layout:
        use_decode_layout_(model)
    result = {"config": {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                         "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers},
              "weight_bytes": wb, "build_s": time.perf_counter() - t, "ceilings": ceil,
              "decode_layout": a.decode_layout}
    print(f"k3-shaped, {cfg.num_experts} experts: {wb['total'] / 1e9:.2f} GB of weights ({wb['experts'] / 1e9:.2f} GB "
          f"packed MXFP4 experts{' in the decode layout' if a.decode_layout else ''}, {wb['dense'] / 1e9:.2f} GB "
          f"the rest), built in {result['build_s']:.0f} s"
          + (f", {torch.cuda.max_memory_allocated() / 1e9:.1f} GB peak" if cuda else ""), flush=True)

    def record():
        if cuda:
            save("k3_shaped", result)
        elif os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "k3_shaped_quick.json"), "w") as fh:
                json.dump(result, fh, indent=1)

    decode_cols = ["batch", "context", "mode", "step ms", "tok/s", "experts read", "experts routed", "GB read",
                   "expert GB", "floor ms (copy bw)", "% of copy-bw floor", "% of 4.8 TB/s"]
    if not a.no_decode:
        batches = [int(b) for b in a.batches.split(",")]
        result["decode"] = decode_rows(model, cfg, batches, a.context, copy_bw, cuda)
        print(table(result["decode"], decode_cols), flush=True)
        record()
    if not a.no_serve:
        def keep(rows):
            result["serve"] = [{"run": n, **s} for n, s in rows]
            record()
        rows, roof = serve_rows(model, cfg, a, copy_bw, keep)
        result["serve_roofline"] = roof
        record()
    if "decode" in result:
        print(table(result["decode"], decode_cols))
    if "serve" in result:
        from k3.serve.bench import format_table
        print(format_table([(r["run"], r) for r in result["serve"]]))
        print(table([result["serve_roofline"]], list(result["serve_roofline"])))
        problems = [f"{r['run']}: {p}" for r in result["serve"] for p in r["problems"]]
        if problems:
            print("sanity checks FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
