"""Served throughput of one model on 1 rank and on N (issue 22: 2 GPUs >= 1.7x one): `k3 serve --model DIR
--nproc N --ep E --tp T` for each layout, started as a user starts it in a process of its own
(k3.serve.local_server.serve_process), and loaded by k3's load generator in another process (k3.serve.bench.run_load,
as `k3 bench serve`): at each concurrency c, a warm-up wave of c requests, then --waves x c timed requests of random
prompts (--input-len words, --output-len tokens, greedy, ignore_eos).

Rows: output tokens/s, TTFT and TPOT (mean / median / p99 ms), decode tokens/s of one stream (1 / mean TPOT), and
`vs 1 rank`: the layout's output tokens/s over the one-rank row's at the same c. One rank is `k3 serve` on one
device with its own defaults (engine process, prefill graphs on CUDA); N ranks run the lockstep engine
(k3.serve.distributed). Roofline (models with MXFP4 experts, e.g. `--init k3-shaped`): the bytes one decode step of
c rows reads on one rank (its dense part / tp, its experts / ep at the expected share touched, KDA state / tp, MLA
latents whole; `bench_k3_shaped.step_bytes` per part) over the H200's 4.8 TB/s datasheet bandwidth, as output tokens/s.

Model: --model DIR, or --init PRESET [--experts N]: a random checkpoint of the preset written once into --dir by
`k3 init`'s writer (k3.checkpoint.random_init; MXFP4 experts packed on the GPU with --device cuda).
Run (2 x H200):  python benchmarks/bench_serve_scaling.py --init k3-shaped --dir /tmp/k3s --device cuda --nproc 1,2
CPU check (gloo):  python benchmarks/bench_serve_scaling.py --init tiny --nproc 1,2 --concurrency 2 --output-len 8
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

H200_BYTES_PER_S = 4.8e12


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a k3 model directory")
    src.add_argument("--init", metavar="PRESET", help="a random checkpoint of this preset, written into --dir")
    ap.add_argument("--experts", type=int, default=None, help="--init: routed experts per layer (default: preset's)")
    ap.add_argument("--dir", default=None, help="--init: where the checkpoint goes (reused when it is there)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (rank r takes cuda:r)")
    ap.add_argument("--nproc", default="1,2", help="comma list of rank counts; each a layout")
    ap.add_argument("--ep", type=int, default=None, help="ranks sharing one copy of the experts (default: all)")
    ap.add_argument("--tp", type=int, default=1, help="ranks splitting attention and dense parts by heads")
    ap.add_argument("--concurrency", default="1,8,64", help="comma list of concurrent streams")
    ap.add_argument("--input-len", type=int, default=256, help="prompt words")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="timed requests per stream")
    ap.add_argument("--memory-gib", type=float, default=16.0, help="each rank's KV pool + KDA state budget")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--match-unit", type=int, default=16)
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a layout may take to load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here after each one")
    a = ap.parse_args(argv)
    a.nproc = [int(n) for n in a.nproc.split(",")]
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if min(a.nproc) < 1 or min(a.concurrency) < 1 or a.waves < 1:
        ap.error("--nproc, --concurrency and --waves take whole numbers >= 1")
    return a


def model_dir(a) -> Path:
    """--model, or the --init checkpoint: --dir itself where it holds one, else --dir/model, written unless there
    (in bf16 with MXFP4 experts packed on the GPU for --device cuda; in float32 with float experts on the CPU)."""
    if a.model:
        return Path(a.model)
    import torch

    from k3.checkpoint.random_init import write_random_checkpoint
    from k3.config import K3Config

    d = Path(a.dir or tempfile.mkdtemp(prefix="k3-scaling-"))
    if (d / "config.json").is_file():
        return d
    d = d / "model"
    if not (d / "config.json").is_file():
        config = K3Config.preset(a.init)
        if a.experts:
            config = config.replace(num_experts=a.experts)
        cuda = a.device.startswith("cuda")
        t = time.perf_counter()
        r = write_random_checkpoint(config, d, "mxfp4" if cuda else "bf16", seed=a.seed,
                                    dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu",
                                    workers=4 if cuda else 1)
        print(f"wrote {a.init} to {d} ({r['bytes'] / 1e9:.1f} GB, {r['shards']} shards) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    return d


def roofline(d: Path, concurrency: int, context: int, ep: int, tp: int) -> float | None:
    """Output tokens/s at the H200's bandwidth for one rank's decode-step bytes (see the docstring), or None where
    the experts are not MXFP4 (the byte model is bench_k3_shaped's, made for the packed K3-shaped preset)."""
    from bench_k3_shaped import step_bytes

    meta = _meta_model(d)
    if meta is None:
        return None
    parts = step_bytes(*meta, concurrency, context)
    per_rank = parts["dense"] / tp + parts["experts"] / ep + parts["state"] / tp + parts["kv"]
    return concurrency * H200_BYTES_PER_S / per_rank


@functools.lru_cache(maxsize=None)
def _meta_model(d: Path):
    """(the checkpoint's model on the meta device with its experts packed as MXFP4 and bf16 weights, its config),
    made once a checkpoint for every row's roofline; None where its experts are not MXFP4."""
    import torch

    from k3.checkpoint.convert import config_experts_format
    from k3.checkpoint.names import is_f32
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.model.moe import Experts
    from k3.ops.mx_experts import pack_experts_

    config = K3Config.from_pretrained(d)
    if config_experts_format(config) != "mxfp4":
        return None
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
        for m in model.modules():
            if isinstance(m, Experts):
                pack_experts_(m, empty=True)
        for name, p in model.named_parameters():
            if not is_f32(name):
                p.data = p.data.to(torch.bfloat16)
    return model, config


def run_layout(d: Path, a, nproc: int, log_dir: Path, done: list[dict]) -> list[dict]:
    """One layout's rows, a concurrency each, from one `k3 serve` start (`done`: the rows before, for the ratio)."""
    from k3.serve.bench import run_load_in_own_process
    from k3.serve.local_server import serve_process

    ep, tp = (a.ep or nproc, a.tp) if nproc > 1 else (1, 1)
    flags = ["--served-model-name", "m", "--device", a.device, "--memory-gib", str(a.memory_gib),
             "--max-num-seqs", str(a.max_num_seqs), "--max-batch-tokens", str(a.max_batch_tokens),
             "--block-size", str(a.block_size), "--match-unit", str(a.match_unit)]
    if nproc > 1:
        flags += ["--nproc", str(nproc), "--ep", str(ep), "--tp", str(tp)]
    env = {"K3_CPU_THREADS": "1"} if a.device == "cpu" else {}
    rows = []
    t = time.perf_counter()
    with serve_process(d, log_dir / f"serve_nproc{nproc}.log", *flags, timeout=a.startup_timeout, env=env) as url:
        print(f"nproc {nproc} (ep {ep}, tp {tp}): serving after "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        print("\n".join(format_rows([]).splitlines()[:2]), flush=True)
        for c in a.concurrency:
            load = lambda n, seed: run_load_in_own_process(url, "m", "random", n, c, None, a.input_len,  # noqa: E731
                                                           a.output_len, 1, None, seed)
            load(c, a.seed + 1)  # warm-up wave: other prompts, so the timed ones find no cached prefix
            s = load(a.waves * c, a.seed)
            if s["failed"] or s["wrong_length"]:
                raise SystemExit(f"nproc {nproc}, c={c}: {s['failed']} requests failed, {s['wrong_length']} "
                                 f"answered with other than {a.output_len} tokens (log: {log_dir})")
            rows.append(dict(nproc=nproc, ep=ep, tp=tp, concurrency=c, **s,
                             decode_tok_per_s_stream=1e3 / s["tpot_ms"]["mean"],
                             roofline_tok_per_s=roofline(d, c, a.input_len + a.output_len // 2, ep, tp)))
            print(format_rows(done + rows).splitlines()[-1], flush=True)
    return rows


def format_rows(rows: list[dict]) -> str:
    one = {r["concurrency"]: r["out_tok_per_s"] for r in rows if r["nproc"] == 1}
    f = lambda d: "/".join(f"{d[k]:.0f}" for k in ("mean", "median", "p99"))  # noqa: E731
    lines = ["| ranks (ep, tp) | c | out tok/s | vs 1 rank | TTFT ms | TPOT ms | decode tok/s a stream "
             "| roofline tok/s | of roofline |", "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['out_tok_per_s'] / one[r['concurrency']]:.2f}x" if r["concurrency"] in one else "-"
        roof = r["roofline_tok_per_s"]
        roof_cols = "- | -" if roof is None else f"{roof:.0f} | {r['out_tok_per_s'] / roof:.1%}"
        lines.append(f"| {r['nproc']} ({r['ep']}, {r['tp']}) | {r['concurrency']} | {r['out_tok_per_s']:.1f} | {vs} | "
                     f"{f(r['ttft_ms'])} | {f(r['tpot_ms'])} | {r['decode_tok_per_s_stream']:.1f} | {roof_cols} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    d = model_dir(a)
    log_dir = Path(tempfile.mkdtemp(prefix="k3-scaling-logs-"))
    rows = []
    for n in a.nproc:
        rows += run_layout(d, a, n, log_dir, rows)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2))
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
