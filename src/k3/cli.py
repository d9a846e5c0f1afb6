"""The `k3` command: train | generate | info | serve | bench serve."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _launch_torchrun(a) -> int | None:
    """`--nproc N` outside torchrun: check the layout, then re-run this command under torch.distributed.run
    (N local processes, gloo on CPU / NCCL on GPU). Returns its exit code, or None to train in-process."""
    import os
    inside = "LOCAL_RANK" in os.environ  # already one of torchrun's processes
    nproc = int(os.environ.get("WORLD_SIZE", 1)) if inside else a.nproc
    cp = a.cp
    dp = a.dp or max(nproc // cp, 1)
    if nproc == 1 and dp * cp == 1 and a.ep == 1:
        return None
    from k3.config import K3Config
    from k3.parallel.mesh import ParallelDims
    ParallelDims(dp=dp, ep=a.ep, cp=cp).validate(world_size=nproc, num_experts=K3Config.preset(a.preset).num_experts,
                                                 seq_len=a.seq_len)
    if a.batch_size % dp:
        raise CLIError(f"--batch-size {a.batch_size} must be divisible by --dp {dp} (rows split over ranks)")
    a.dp = dp
    if inside:
        return None
    import subprocess
    if sys.argv[1:2] != ["train"]:
        raise CLIError("--nproc > 1 is launched from the command line (`k3 train --nproc N ...`)")
    # torchrun's own parser would take --nproc for --nproc-per-node: the children learn it from WORLD_SIZE
    rest, skip = [], False
    for arg in sys.argv[2:]:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        rest.append(arg)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "k3.cli", "train", *rest, "--dp", str(dp)]
    return subprocess.call(argv)


_VISION_TRAIN_DEFAULTS = {"out": "runs/vision", "max_steps": 400, "batch_size": 16, "lr": 3e-3, "eval_every": 100}


def cmd_train_vision(a) -> int:
    from k3.vision.train_vision import VisionTrainConfig, run

    defaults = build_parser()._subparsers._group_actions[0].choices["train"]  # flags left at the text defaults
    kw = {k: (v if getattr(a, k) == defaults.get_default(k) else getattr(a, k)) for k, v in _VISION_TRAIN_DEFAULTS.items()}
    device = "cpu" if a.device == "auto" else a.device
    s = run(VisionTrainConfig(time_budget=a.time_budget, seed=a.seed, device=device, **kw))
    print()
    print(f"steps {s['steps']}{' (stopped by --time-budget)' if s['stopped_early'] else ''} in {s['seconds']:.0f} s")
    for split, kinds in s["accuracy"].items():
        print(f"{split:>16} accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds.items()))
    print(f"held-out (unseen colour-shape combinations) accuracy: {s['heldout_accuracy']:.3f}; "
          f"in-distribution: {s['in_distribution_accuracy']:.3f}")
    print(f"model: {s['model_dir']}   metrics: {Path(kw['out']) / 'metrics.jsonl'}")
    return 0


def cmd_train(a) -> int:
    from k3.train.trainer import TrainConfig, Trainer

    if getattr(a, "task", "text") == "vision":
        return cmd_train_vision(a)
    launched = _launch_torchrun(a)
    if launched is not None:
        return launched

    cfg = TrainConfig(preset=a.preset, out=a.out, corpus=a.corpus, tokenizer=a.tokenizer, max_steps=a.max_steps,
                      time_budget=a.time_budget, batch_size=a.batch_size, seq_len=a.seq_len,
                      grad_accum=a.grad_accum, lr=a.lr, optimizer=a.optimizer, balance=a.balance,
                      eval_every=a.eval_every, save_every=a.save_every, seed=a.seed, resume=a.resume,
                      device=a.device, warmup_steps=a.warmup_steps, qat=a.qat, dp=a.dp or 1, ep=a.ep, cp=a.cp,
                      fsdp=a.fsdp, activation_checkpointing=a.activation_checkpointing)
    from k3.config import K3Config
    K3Config.preset(cfg.preset)  # unknown preset: fail before loading data
    s = Trainer(cfg).run()
    if "rank" in s:  # a non-zero rank of a multi-process run: rank 0 prints the summary
        return 0
    print()
    print(f"steps {s['steps']}{' (stopped by --time-budget)' if s['stopped_early'] else ''}")
    print(f"validation loss {s['val_loss']:.4f} nats/token (perplexity {s['val_ppl']:.1f})")
    print(f"unigram baseline {s['unigram_baseline']:.4f} nats/token -> {s['gain_over_unigram']:.3f} nats better")
    if s["maxvio_mean_last"] is not None:
        print(f"MaxVio (mean over MoE layers, last step, balance={s['balance']}): {s['maxvio_mean_last']:.3f}")
    print(f"model: {s['model_dir']}   metrics: {Path(cfg.out) / 'metrics.jsonl'}   plots: {Path(cfg.out) / 'loss.png'}")
    print(f"sample: {s['sample']}")
    return 0


def cmd_generate(a) -> int:
    import torch

    from k3.data import Tokenizer
    from k3.model.decoder import K3ForCausalLM
    from k3.model.generate import stream_generate

    model_dir = Path(a.model)
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"--model {model_dir}: no config.json there (train one with `k3 train`)")
    tok_path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_path if tok_path.is_file() else None)
    if a.image:
        return _generate_with_images(a, model_dir, tokenizer)
    model = K3ForCausalLM.from_pretrained(model_dir)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CLIError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
    ids = tokenizer.encode(a.prompt, add_bos=True)
    tokens = stream_generate(model, torch.tensor([ids]), max_new_tokens=a.max_new_tokens,
                             temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                             eos_token_id=tokenizer.eos_id)
    return _print_stream(a.prompt, tokens, tokenizer)


def _print_stream(prompt: str, tokens, tokenizer) -> int:
    """Writes the prompt, then each generated token's text as it arrives, until EOS."""
    stream = tokenizer.decode_stream(skip_special_tokens=True)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    for tok in tokens:
        t = int(tok[0])
        if t == tokenizer.eos_id:
            break
        sys.stdout.write(stream.step(t))
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _generate_with_images(a, model_dir: Path, tokenizer) -> int:
    """`k3 generate --image FILE ...`: the images' media blocks, then the prompt, through a vision model."""
    import torch

    from k3.vision.checkpoint import has_vision
    from k3.vision.multimodal import K3ForConditionalGeneration, image_token_ids
    from k3.vision.preprocess import ImageError, preprocess_image

    if not has_vision(model_dir):
        raise CLIError(f"--image needs a vision model, but {model_dir}/config.json has no vision_config "
                       f"(train one with `k3 train --task vision`)")
    model = K3ForConditionalGeneration.from_pretrained(model_dir)
    images = []
    for path in a.image:
        try:
            images.append(preprocess_image(Path(path), model.vision_config))
        except ImageError as e:
            raise CLIError(f"--image {path}: {e}") from None
    ids = [tokenizer.bos_id] + [t for im in images for t in image_token_ids(tokenizer, im)] + tokenizer.encode(a.prompt)
    tokens = model.stream_generate(torch.tensor([ids]), images, max_new_tokens=a.max_new_tokens,
                                   temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                                   eos_token_id=tokenizer.eos_id)
    return _print_stream(a.prompt, tokens, tokenizer)


def cmd_plan(a) -> int:
    from k3.config import K3Config
    from k3.parallel.memory_plan import format_plan, parse_bytes, plan_memory, smallest_fit

    config = K3Config.preset(a.preset)
    mem = parse_bytes(a.gpu_memory)
    kw = dict(mode=a.mode, seq_len=a.seq_len, batch=a.batch, optimizer=a.optimizer)
    p = plan_memory(config, a.gpus, mem, dp=a.dp, ep=a.ep, cp=a.cp, **kw)
    best = smallest_fit(config, mem, cp=a.cp, **kw)
    if a.json:
        row = lambda q: None if q is None else {"gpus": q.gpus, "dp": q.dp, "ep": q.ep, "cp": q.cp,
                                               "parts": q.parts, "total": q.total, "fits": q.fits}
        print(json.dumps({"plan": row(p), "smallest": row(best), "gpu_memory": mem}, indent=2))
    else:
        print(format_plan(p, best))
    return 0 if p.fits else 1


def cmd_info(a) -> int:
    from k3.config import K3Config
    from k3.info import format_report, model_report

    if a.verify and not a.dir:
        raise CLIError("--verify needs a checkpoint directory: k3 info DIR --verify")
    if a.dir:
        config, name = K3Config.from_pretrained(a.dir), str(a.dir)
    else:
        config, name = K3Config.preset(a.preset), a.preset
    report = model_report(config)
    if a.dir and Path(a.dir).is_dir():
        from k3.checkpoint.convert import inventory, verify_checkpoint
        report["inventory"] = inventory(a.dir)
        if a.verify:
            report["verify"] = verify_checkpoint(a.dir)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(name, config, report))
        if "inventory" in report:
            print(_format_inventory(report["inventory"]))
        if "verify" in report:
            print(_format_verify(report["verify"]))
    return 1 if report.get("verify", {}).get("problems") else 0


def _format_inventory(inv: dict) -> str:
    dts = ", ".join(f"{dt} {n:,} ({inv['bytes_by_dtype'][dt]:,} B)" for dt, n in sorted(inv["tensors_by_dtype"].items()))
    experts = ", ".join(f"{k} {v:,}" for k, v in sorted(inv["expert_tensors"].items())) or "none"
    return (f"  files: {inv['shards']} shards, {inv['text_tensors']:,} text tensors ({inv['text_bytes']:,} B), "
            f"{inv['vision_tensors']:,} vision tensors\n  by dtype: {dts}\n  expert tensors: {experts}")


def _format_verify(v: dict) -> str:
    head = (f"  verify ({v['experts']} experts): {v['text_tensors']:,}/{v['expected_tensors']:,} tensors, "
            f"{v['text_bytes']:,}/{v['expected_bytes']:,} bytes: ")
    if not v["problems"]:
        return head + "OK"
    shown = "\n    ".join(v["problems"][:30])
    more = f"\n    ... and {len(v['problems']) - 30} more" if len(v["problems"]) > 30 else ""
    return head + f"{len(v['problems'])} problems\n    {shown}{more}"


def cmd_convert(a) -> int:
    from k3.checkpoint.convert import convert_checkpoint

    if not (Path(a.src) / "config.json").is_file():
        raise CLIError(f"IN {a.src}: no config.json there")
    v = convert_checkpoint(a.src, a.dst, a.experts, max_shard_bytes=a.shard_size)
    print(f"wrote {a.dst} with {a.experts} experts")
    print(_format_verify(v))
    return 1 if v["problems"] else 0


def _size(s: str) -> int:
    """A byte count with an optional K/M/G/T suffix (powers of 1024), e.g. 5G."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = s.strip().upper().removesuffix("B") or "x"
    mult = units.get(t[-1], 1)
    try:
        v = int(float(t[:-1] if t[-1] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 5G, 500M or 1048576, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {s!r}")
    return v


def _engine_config(a):
    from k3.serve.engine import EngineConfig

    return EngineConfig(memory_bytes=int(a.memory_gib * 2**30), block_size=a.block_size, match_unit=a.match_unit,
                        max_batch_tokens=a.max_batch_tokens, max_num_seqs=a.max_num_seqs,
                        prefix_caching=not a.no_prefix_caching)


def _add_engine_args(p: argparse.ArgumentParser, block: int, unit: int) -> None:
    p.add_argument("--memory-gib", type=_positive_float, default=1.0, help="KV pool + KDA state budget (GiB)")
    p.add_argument("--block-size", type=_positive_int, default=block, help="tokens per physical MLA block")
    p.add_argument("--match-unit", type=_positive_int, default=unit, help="prefix-hash granularity (divides block size)")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=2048, help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="concurrently running sequences")
    p.add_argument("--no-prefix-caching", action="store_true")


def cmd_serve(a) -> int:
    from k3.serve.api import serve

    try:
        serve(a.model, host=a.host, port=a.port, api_key=a.api_key, engine_config=_engine_config(a),
              model_name=a.served_model_name, device=a.device)
    except ImportError as e:
        raise CLIError(f"{e.name} is missing: install the serve extra (pip install 'k3[serve]')") from None
    return 0


def cmd_bench_serve(a) -> int:
    import dataclasses
    import time

    import torch

    from k3.data import Tokenizer
    from k3.serve import bench

    if a.quick:  # a small CPU-sized sanity run of every path: engine (both datasets), baseline, checks
        a.concurrency, a.num_prompts, a.prompts_per_concurrency = "1,4", 2, 2
        a.input_len, a.output_len, a.turns, a.request_rate = 16, 8, 2, None
    torch.manual_seed(a.seed)
    # On a shared CPU, OpenMP spin-waiting across threads can slow small ops 10x; one thread is steadier.
    torch.set_num_threads(a.threads or (1 if a.device == "cpu" else torch.get_num_threads()))
    if a.model:
        from k3.model.decoder import K3ForCausalLM
        model_dir = Path(a.model)
        if not (model_dir / "config.json").is_file():
            raise CLIError(f"--model {model_dir}: no config.json there")
        tok_path = model_dir / "tokenizer.json"
        tokenizer = Tokenizer.from_file(tok_path if tok_path.is_file() else None)
        model = K3ForCausalLM.from_pretrained(model_dir, device=a.device)
    else:
        from k3 import K3Config, K3ForCausalLM
        tokenizer = Tokenizer.from_file()
        with torch.device(a.device):  # built where it runs: no host copy of the weights first
            model = K3ForCausalLM(K3Config.preset(a.preset), init=False)  # the seeded init below is the one
        model.reset_parameters(seed=a.seed)
    model.eval()
    if a.dtype != "float32":
        model = model.to(getattr(torch, a.dtype))
    engine_config = dataclasses.replace(_engine_config(a), num_state_slots=a.num_state_slots)
    levels = [int(c) for c in a.concurrency.split(",")] if a.concurrency else [None]
    datasets = a.dataset.split(",")
    rows, problems = [], []
    t_start = time.perf_counter()

    def record(name: str, s: dict) -> None:
        rows.append((name, s))
        problems.extend(f"{name}: {p}" for p in s["problems"])
        print(f"{bench.format_table(rows[-1:]).splitlines()[-1]}  ({time.perf_counter() - t_start:.0f} s)",
              flush=True)
        if a.json:  # after every row, so a run cut short still leaves its results
            Path(a.json).write_text(json.dumps([{"run": n, **r} for n, r in rows], indent=2))

    with torch.inference_mode():
        # Warm-up (CUDA context, kernels, allocator): otherwise the first timed run pays for it.
        bench.run_engine(model, tokenizer, engine_config, "random", 2, 2, None, min(a.input_len, 16), 4, 1, a.seed,
                         on_start=lambda e: print(f"engine: {e.describe_capacity()}", flush=True))
        bench.static_batch_baseline(model, tokenizer, 2, 2, min(a.input_len, 16), 4, a.seed)
        for level in levels:
            n = bench.requests_per_level(level, a.num_prompts, a.prompts_per_concurrency)
            for dataset in datasets:
                s = bench.run_engine(model, tokenizer, engine_config, dataset, n, level, a.request_rate, a.input_len,
                                     a.output_len, a.turns, a.seed, warmup=True)
                record(f"engine {dataset} c={level}" if level else f"engine {dataset} rate={a.request_rate}/s", s)
            if a.baseline and level:
                s = bench.static_batch_baseline(model, tokenizer, n, level, a.input_len, a.output_len, a.seed,
                                                warmup=True)
                record(f"static generate batch={level}", s)
    print()
    print(bench.format_table(rows))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if problems:
        print("sanity checks FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("sanity checks passed: no failed request, every output exactly --output-len tokens, pools empty after")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 from scratch: build, train, generate, inspect.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a K3 on the bundled corpus (defaults: tiny preset, ~10 min on 2 CPU cores)")
    t.add_argument("--task", choices=["text", "vision"], default="text",
                   help="text: the bundled corpus; vision: a tiny vision-language model on synthetic scenes "
                        "(defaults then: --out runs/vision --max-steps 400 --batch-size 16 --lr 3e-3)")
    t.add_argument("--preset", default="tiny")
    t.add_argument("--out", default="runs/tiny", help="run directory (checkpoints, metrics, plots, model)")
    t.add_argument("--corpus", default=None, help="a .jsonl.xz corpus (default: bundled Shakespeare)")
    t.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: bundled BPE)")
    t.add_argument("--max-steps", type=_positive_int, default=300)
    t.add_argument("--time-budget", type=_positive_float, default=None, help="seconds; stop early, then evaluate and save")
    t.add_argument("--batch-size", type=_positive_int, default=16)
    t.add_argument("--seq-len", type=_positive_int, default=256)
    t.add_argument("--grad-accum", type=_positive_int, default=1)
    t.add_argument("--lr", type=_positive_float, default=0.01)
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    t.add_argument("--balance", choices=["quantile", "sign", "none"], default="quantile")
    t.add_argument("--eval-every", type=_positive_int, default=50)
    t.add_argument("--save-every", type=_positive_int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    t.add_argument("--qat", action="store_true",
                   help="quantization-aware training: MXFP4 routed-expert weights, MXFP8 expert activations")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each decoder layer's inputs and recompute the layer in backward "
                        "(far less activation memory, about one more forward of compute)")
    t.add_argument("--nproc", type=_positive_int, default=1, help="processes to launch through torchrun")
    t.add_argument("--dp", type=_positive_int, default=None, help="data parallel size (default nproc / cp)")
    t.add_argument("--ep", type=_positive_int, default=1, help="expert parallel size (divides dp × cp and the experts)")
    t.add_argument("--cp", type=_positive_int, default=1, help="context parallel size (KDA state scan, MLA KV gather)")
    t.add_argument("--fsdp", action="store_true",
                   help="FSDP2: shard the non-expert parameters and their optimizer state over all processes")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="per-GPU memory of a training or serving layout; smallest GPU count that fits")
    pl.add_argument("--preset", default="kimi-k3")
    pl.add_argument("--gpus", type=_positive_int, required=True)
    pl.add_argument("--gpu-memory", default="141GB", help="per GPU: 141GB (10^9 B), 80GiB (2^30 B), ...")
    pl.add_argument("--mode", choices=["train", "serve"], default="train")
    pl.add_argument("--dp", type=_positive_int, default=None)
    pl.add_argument("--ep", type=_positive_int, default=None, help="default gcd(gpus, experts)")
    pl.add_argument("--cp", type=_positive_int, default=None)
    pl.add_argument("--seq-len", "--context", dest="seq_len", type=_positive_int, default=8192,
                    help="training sequence length / serving context")
    pl.add_argument("--batch", type=_positive_int, default=None, help="global sequences (default: one per dp rank)")
    pl.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="generate text from a trained model directory")
    g.add_argument("--model", required=True, help="a directory written by `k3 train` (e.g. runs/tiny/model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image file placed before the prompt (repeatable; needs a vision model)")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="parameter breakdown, activated parameters, cache and checkpoint sizes")
    i.add_argument("dir", nargs="?", default=None, help="a checkpoint directory (reads its config.json)")
    i.add_argument("--preset", default="kimi-k3")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true",
                   help="check DIR against its config: tensor names, shapes, dtypes, counts, bytes (exit 1 on problems)")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("convert", help="re-encode a checkpoint's routed experts (MXFP4 <-> bf16), shard by shard")
    c.add_argument("src", metavar="IN", help="a checkpoint directory")
    c.add_argument("dst", metavar="OUT", help="the directory to write")
    c.add_argument("--experts", choices=["mxfp4", "bf16"], required=True)
    c.add_argument("--shard-size", type=_size, default=5 * 2**30, help="largest shard, e.g. 5G (default), 500M")
    c.set_defaults(func=cmd_convert)

    sv = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    sv.add_argument("--model", required=True, help="a model directory (config.json + safetensors)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_positive_int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    sv.add_argument("--served-model-name", default=None, help="model id clients use (default: directory name)")
    sv.add_argument("--device", default="cpu")
    _add_engine_args(sv, block=2048, unit=512)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("serve", help="load-test the serving engine over HTTP (TTFT, TPOT, ITL, e2e, hit rate)")
    bs.add_argument("--model", default=None, help="a model directory (default: a random --preset model)")
    bs.add_argument("--preset", default="tiny")
    bs.add_argument("--device", default="cpu")
    bs.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bs.add_argument("--concurrency", default="1,8,32", help="comma-separated max concurrency levels")
    bs.add_argument("--request-rate", type=_positive_float, default=None, help="Poisson arrivals per second")
    bs.add_argument("--dataset", default="random,multiturn", help="random and/or multiturn")
    bs.add_argument("--num-prompts", type=_positive_int, default=32, help="requests per level, at least")
    bs.add_argument("--prompts-per-concurrency", type=_positive_int, default=1,
                    help="requests per level = max(--num-prompts, this x concurrency): the same number of waves "
                         "at every level (multi-turn: set it to --turns for one conversation per concurrent slot)")
    bs.add_argument("--input-len", type=_positive_int, default=64, help="prompt length in words")
    bs.add_argument("--output-len", type=_positive_int, default=32)
    bs.add_argument("--turns", type=_positive_int, default=4, help="turns per multi-turn conversation")
    bs.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the static-batch generate baseline")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: 1 on CPU)")
    bs.add_argument("--json", default=None, help="write the results here (after every row)")
    bs.add_argument("--quick", action="store_true",
                    help="a small sanity run: concurrency 1,4, 2 requests per concurrent slot of 16 words and 8 "
                         "tokens out, 2 turns (overrides those flags)")
    _add_engine_args(bs, block=256, unit=16)
    bs.add_argument("--num-state-slots", type=_positive_int, default=None,
                    help="KDA state slots, running sequences + prefix-cache checkpoints (default 2 x --max-num-seqs)")
    bs.set_defaults(func=cmd_bench_serve)

    from k3.agentenv.commands import add_agentenv_parser
    add_agentenv_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from k3.checkpoint.hf import CheckpointError
    from k3.config import ConfigError
    from k3.data import CorpusError, TokenizerError

    try:
        return args.func(args)
    except (CLIError, ConfigError, CorpusError, TokenizerError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
