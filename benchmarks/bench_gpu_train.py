"""Training step of the `small` preset on one GPU: tokens/s and MFU against 989 TFLOP/s dense bf16.

bf16 parameters, fused AdamW, packed rows of B x T tokens, loss = next-token cross entropy.
FLOP formula (per step): 6 · N_active · tokens  +  3 · Σ_MLA-layers 2·2·B·H·(T²/2)·(d_qk + d_v)/2,
where N_active counts every matmul weight a token uses (all attention/KDA/MLP/shared/router/latent
projections, lm_head, and top_k/E of the routed experts; embeddings and norms excluded), and the second term
is causal softmax attention (QKᵀ with d_qk, PV with d_v, half the T² square, x3 for fwd+bwd). KDA's chunked
delta-rule arithmetic is not counted (it is O(T·H·C·d), a few % here), so the MFU slightly under-counts.
--activation-checkpointing recomputes each decoder layer in backward (the FLOP formula, and so MFU, still counts
one forward: the recomputation is overhead). A shape that runs out of memory prints an OOM row with the peak
memory reached and the run goes on to the next shape.
--off SWITCHES (repeatable): after the default row of each shape, one more row with those k3.envs switches set
(a comma list of Switches fields, e.g. no_shared_input_grad,no_block_grad_buffer; a kernel list as
no_triton:_sigmoid_gate_triton; a choice as field=value, e.g. kda_bwd=fla; a switch that is on by default as
fla_keep_forward=0), in the same process, so a fast path's
before and after are timed side by side.
--launch MODULE:k=v[,k=v] (repeatable): one more row per shape with that k3.ops kernel module's LAUNCH entries
changed (e.g. _attn_res_triton:preload=true), launch candidates judged by the whole step.
--compile: each shape's rows once more with the KDA, MLA, MoE and dense MLP forwards compiled
(k3.train.compiled_regions, `k3 train --compile`), in the same process after the eager rows (which run the compiled
functions eagerly: torch.compiler.set_stance("force_eager")); first_step_s is a compiled row's first step, compile
included, from an empty Dynamo cache (reset per shape, so each shape gets its own static-shape graphs).
--docs L: the rows packed with documents of L tokens (doc_ids, as `k3 train` packs its corpus: KDA's varlen core,
MLA's attention a varlen segment a document); the FLOP count stays the whole rows' causal one.
Run: PYTHONPATH=src python benchmarks/bench_gpu_train.py [--quick] [--activation-checkpointing] [--compile] [--off ...]
     [--docs L] [--launch MODULE:k=v]
"""
import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import PEAK_BF16, active_params, changed_launch, parse_launch, save, table, time_ms  # noqa: E402

from k3 import envs  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    ap.add_argument("--compile", action="store_true",
                    help="a further row per shape with the KDA, MLA, MoE and dense MLP forwards compiled")
    ap.add_argument("--off", action="append", default=[], metavar="SWITCHES",
                    help="a further row per shape with these k3.envs switches set True (comma list of fields)")
    ap.add_argument("--docs", type=int, default=0, metavar="L", help="pack each row with documents of L tokens")
    ap.add_argument("--launch", action="append", default=[], metavar="MODULE:k=v[,k=v]",
                    help="a further row per shape with that kernel module's LAUNCH entries changed")
    a = ap.parse_args()
    try:
        launches = {spec: parse_launch(spec) for spec in a.launch}
    except ValueError as e:
        ap.error(str(e))
    variants = [()] + [tuple(sorted(n.strip() for n in v.split(",") if n.strip())) for v in a.off]
    known = {f.name: f.type in (bool, "bool") for f in dataclasses.fields(envs.Switches)}
    lists = ("no_triton", "triton_opt_in")
    choices = {"kda_bwd": envs.KDA_BWD_CHOICES}
    bad = sorted({n for names in variants for n in names
                  if not (known.get(n) or (n.partition(":")[0] in lists and n.partition(":")[2])
                          or n.partition("=")[2] in choices.get(n.partition("=")[0], ())
                          or (known.get(n.partition("=")[0]) and n.partition("=")[2] in ("0", "1")))})
    if bad:  # refused before any timing
        ap.error(f"--off: unknown switch(es) {bad}; on/off switches: {sorted(n for n, b in known.items() if b)}, "
                 f"or {'/'.join(lists)}:MODULE[:MODULE...], or FIELD=VALUE of {choices}, or SWITCH=0 / SWITCH=1")
    # a row's (k3.envs switches, --launch spec): the default, each --off, each --launch
    variants = [(names, None) for names in variants] + [((), spec) for spec in launches]
    preset = "small" if not a.quick else "tiny"
    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    model.model.gradient_checkpointing = a.activation_checkpointing
    if a.compile:
        from k3.train.compiled_regions import compile_regions
        compile_regions(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n_act = active_params(model, cfg)
    H, dqk, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    n_mla = len(cfg.mla_layer_ids)
    rows = []
    shapes = [(8, 4096), (2, 16384)] if not a.quick else [(2, 512)]
    modes = (False, True) if a.compile else (False,)
    for (B, T), compiled, (off, spec) in ((shape, c, v) for shape in shapes for c in modes for v in variants):
        ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
        doc_ids = (torch.arange(T, device="cuda") // a.docs).expand(B, T).contiguous() if a.docs else None

        def step():  # (a fresh doc_ids a step, as a loader gives: the packing is read back once a forward)
            loss = model(ids, doc_ids=None if doc_ids is None else doc_ids.clone(), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t0 = time.time()
        torch.cuda.reset_peak_memory_stats()
        label = ",".join(off) or (f"launch {spec}" if spec else "-")
        row = dict(preset=preset, ckpt=a.activation_checkpointing, compiled=compiled, off=label, B=B, T=T,
                   docs=a.docs or "-", active_params_M=n_act / 1e6)
        if compiled and not off and not spec:  # this shape's first compiled row: its graphs compile from scratch
            torch._dynamo.reset()
        try:
            with envs.override(**switches(off)), \
                    changed_launch(*launches[spec]) if spec else contextlib.nullcontext(), \
                    torch.compiler.set_stance("default" if compiled else "force_eager"):
                if compiled:
                    t1 = time.time()
                    step()
                    torch.cuda.synchronize()
                    row.update(first_step_s=time.time() - t1)
                ms = time_ms(step, warmup=2, reps=5)
        except torch.OutOfMemoryError as e:
            row.update(step_ms="OOM", error=str(e).splitlines()[0])
        else:
            tokens = B * T
            flops = 6 * n_act * tokens + 3 * n_mla * 2 * 2 * B * H * (T * T / 2) * (dqk + dv) / 2
            row.update(step_ms=ms, tokens_per_s=tokens / ms * 1e3, TFLOPs=flops / ms * 1e-9,
                       MFU=flops / (ms * 1e-3) / PEAK_BF16)
        row.update(peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30, wall_s=time.time() - t0)
        rows.append(row)
        print(row, flush=True)
        # after an OOM the half-done step's gradients and cached blocks would crowd the next shape
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    print(table(rows, ["preset", "ckpt", "compiled", "off", "B", "T", "docs", "step_ms", "tokens_per_s", "TFLOPs",
                       "MFU", "peak_GiB", "first_step_s", "active_params_M"]))
    save("train" + ("_quick" if a.quick else "") + ("_ckpt" if a.activation_checkpointing else "")
         + ("_compile" if a.compile else ""), {"rows": rows})


def switches(names: tuple[str, ...]) -> dict:
    """--off's names as k3.envs.override arguments: a flag set True, `field:a:b` a kernel list of field,
    `field=value` a choice, `flag=0` / `flag=1` a flag set False / True (for switches on by default)."""
    flags = {f.name for f in dataclasses.fields(envs.Switches) if f.type in (bool, "bool")}
    out = {}
    for n in names:
        if "=" in n:
            field, _, value = n.partition("=")
            out[field] = value == "1" if field in flags else value
            continue
        field, _, modules = n.partition(":")
        out[field] = modules.split(":") if modules else True
    return out


if __name__ == "__main__":
    main()
