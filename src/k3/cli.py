"""The `k3` command: train | generate | info | serve | bench serve."""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already names one or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)".lstrip()

    def _format_action(self, action):
        if action.help is None and self._shows_default(action):  # argparse prints no help line without a help text
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    @staticmethod
    def _shows_default(action) -> bool:
        return bool(action.option_strings) and not any(action.default is v for v in (None, False, argparse.SUPPRESS))


class _Parser(argparse.ArgumentParser):
    """argparse with k3's error line: `k3 train: error: <message>` and exit 2, without the usage block (which
    buries the one line that matters); `k3 train --help` shows the usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_rate(s: str) -> float:
    """A number > 0; `inf` allowed (a rate: as fast as possible, as vLLM's --request-rate inf)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _positive_float(s: str) -> float:
    """A finite number > 0 (a timeout, budget or size of `inf` would never end or never fit)."""
    v = _positive_rate(s)
    if math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s!r}")
    return v


def _preset(s: str) -> str:
    from k3.config import ConfigError, K3Config
    try:
        K3Config.preset(s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _device(s: str, allow_auto: bool = False) -> str:
    """A torch device this machine has: cpu, cuda, cuda:N, mps (and auto where the command picks one)."""
    if allow_auto and s == "auto":
        return s
    import torch
    try:
        d = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps{' or auto' if allow_auto else ''}, "
                                         f"got {s!r}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise argparse.ArgumentTypeError(f"{s}: CUDA is not available ({why}); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{s}: only {torch.cuda.device_count()} CUDA GPU(s) visible "
                                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{s}: MPS is not available on this machine; use --device cpu")
    elif d.type != "cpu":
        raise argparse.ArgumentTypeError(f"unsupported device {s!r}; use cpu, cuda, cuda:N or mps")
    return s


def _device_or_auto(s: str) -> str:
    return _device(s, allow_auto=True)


def tcp_port(s: str) -> int:
    """A TCP port to listen on: 1..65535 (0, an OS-chosen port, would leave clients not knowing where)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {s!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {v}")
    return v


def check_listen_address(host: str, port: int) -> None:
    """Fails with one line when host:port cannot be listened on (taken, not an address of this machine), before
    a server loads anything. Binds the way uvicorn does (SO_REUSEADDR), then lets go."""
    import errno
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            hint = " (another process is listening there; pick another --port)" if e.errno == errno.EADDRINUSE else ""
            raise CLIError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None


def _warn(command: str, message: str) -> None:
    print(f"k3 {command}: warning: {message}", file=sys.stderr)


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
    if a.compile and a.ep > 1:  # (TrainConfig.validate says the same; here before any process starts)
        raise CLIError("--compile does not combine with --ep > 1 (expert parallelism exchanges tokens between "
                       "processes inside the MoE layer); leave one of them off")
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
    from k3.train.run_dir import check_run_dir
    check_run_dir(Path(a.out), resume=a.resume, overwrite=a.overwrite)  # one line here, not one per process
    return subprocess.call(argv)


# the flags `--task vision` honours; every other flag given is refused with the reason (never silently ignored)
_VISION_FLAGS = ("out", "max_steps", "batch_size", "lr", "eval_every", "warmup_steps", "time_budget", "seed",
                 "device", "overwrite")
_VISION_FIXED = {"preset": "tiny", "optimizer": "adamw", "balance": "quantile"}  # what it trains with
_VISION_REFUSED = {
    **dict.fromkeys(("resume", "save_every"), "it trains in one go and writes no checkpoints"),
    **dict.fromkeys(("nproc", "dp", "ep", "cp", "fsdp"), "it trains in one process"),
    **dict.fromkeys(("qat", "activation_checkpointing", "compile"), "not implemented for the vision-language model"),
    **dict.fromkeys(("corpus", "data", "tokenizer", "seq_len", "grad_accum"),
                    "its data are synthetic scenes, one question per row, in the bundled tokenizer"),
    "preset": "it trains its own tiny vision-language model (--preset tiny)",
    "optimizer": "it trains with adamw",
    "balance": "it balances experts with quantile",
}


def cmd_train_vision(a, given: set[str]) -> int:
    from k3.vision.train_vision import VisionTrainConfig, run

    for name in sorted(given - set(_VISION_FLAGS) - {"task"}):
        value = getattr(a, name)
        if name in _VISION_FIXED and value == _VISION_FIXED[name]:
            continue
        flag = f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
        raise CLIError(f"{flag} does not apply to --task vision: {_VISION_REFUSED.get(name, 'not supported there')}")
    kw = {k: getattr(a, k) for k in _VISION_FLAGS if k in given}
    if kw.get("device") == "auto":
        kw["device"] = "cpu"
    cfg = VisionTrainConfig(**kw)
    s = run(cfg)
    print()
    print(f"steps {s['steps']}{' (stopped by --time-budget)' if s['stopped_early'] else ''} in {s['seconds']:.0f} s")
    for split, kinds in s["accuracy"].items():
        print(f"{split:>16} accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds.items()))
    print(f"held-out (unseen colour-shape combinations) accuracy: {s['heldout_accuracy']:.3f}; "
          f"in-distribution: {s['in_distribution_accuracy']:.3f}")
    print(f"model: {s['model_dir']}   metrics: {Path(cfg.out) / 'metrics.jsonl'}")
    return 0


def _given_train_flags(argv: list[str] | None) -> set[str]:
    """The `k3 train` flags on the command line (as dest names), told apart from defaults by parsing again with
    every default suppressed: `--max-steps 300` counts as given although 300 is the default."""
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command", "func"}


# flags a resumed run does not take from the saved run: they belong to this invocation (machine, session time)
_NOT_RESUMED = ("out", "resume", "overwrite", "device", "time_budget")


def _take_saved_run(a, given: set[str]) -> dict:
    """--resume: the saved run's configuration for every flag not given (steps, schedule, batch, sequence
    length, preset, optimizer, layout, ...); a given flag that contradicts it is refused, naming it.
    Returns the saved fields that have no flag (weight decay, clipping, ...)."""
    import os

    from k3.train.run_dir import check_resume_config, saved_train_config
    saved = saved_train_config(Path(a.out), warn=lambda m: None)  # Trainer warns when it skips a damaged one
    for name, value in saved.items():
        if hasattr(a, name) and name not in given and name not in _NOT_RESUMED:
            setattr(a, name, value)
    if "nproc" not in given and "LOCAL_RANK" not in os.environ:  # relaunch the saved run's process count
        a.nproc = saved.get("dp", 1) * saved.get("cp", 1)
    check_resume_config(vars(a), saved, Path(a.out))
    return {k: v for k, v in saved.items() if not hasattr(a, k) and k not in _NOT_RESUMED}


def _check_train_memory(cfg) -> None:
    """A --batch-size × --seq-len step that cannot fit: one line saying what fits, before anything is allocated.
    One process only (ranks hold shards of the work); on a GPU only the weights, gradients and optimizer state
    (the activation probe measures the CPU float32 paths)."""
    import os

    import torch

    from k3.config import K3Config
    from k3.train.memory_estimate import check_train_fits

    if cfg.dp * cfg.cp * cfg.ep > 1 or "LOCAL_RANK" in os.environ:
        return
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    check_train_fits(K3Config.preset(cfg.preset), cfg.batch_size, cfg.seq_len, cfg.optimizer,
                     cfg.activation_checkpointing, device=device, activations=torch.device(device).type == "cpu")


def cmd_train(a) -> int:
    from k3.train.run_dir import RunDirError, default_run_dir
    from k3.train.trainer import TrainConfig, Trainer, train_config_from_dict

    given = _given_train_flags(getattr(a, "argv", None))
    if a.task == "vision":
        return cmd_train_vision(a, given)
    if a.out is None:
        a.out = default_run_dir(a.preset)
    unflagged = _take_saved_run(a, given) if a.resume else {}
    launched = _launch_torchrun(a)
    if launched is not None:
        return launched

    cfg = train_config_from_dict({
        **unflagged, "preset": a.preset, "out": a.out, "corpus": a.corpus, "data": a.data, "tokenizer": a.tokenizer,
        "max_steps": a.max_steps, "time_budget": a.time_budget, "batch_size": a.batch_size, "seq_len": a.seq_len,
        "grad_accum": a.grad_accum, "lr": a.lr, "optimizer": a.optimizer, "balance": a.balance,
        "eval_every": a.eval_every, "save_every": a.save_every, "seed": a.seed, "resume": a.resume,
        "overwrite": a.overwrite, "device": a.device, "warmup_steps": a.warmup_steps, "qat": a.qat,
        "dp": a.dp or 1, "ep": a.ep, "cp": a.cp, "fsdp": a.fsdp, "activation_checkpointing": a.activation_checkpointing,
        "compile": a.compile})
    from k3.config import K3Config
    K3Config.preset(cfg.preset)  # unknown preset: fail before loading data
    _check_train_memory(cfg)
    _start_kernels_early(cfg.device)
    # built outside the try: a missing corpus or tokenizer is reported as itself, not as a failed write
    trainer = Trainer(cfg, warn=lambda msg: print(f"k3 train: warning: {msg}", file=sys.stderr, flush=True))
    try:
        s = trainer.run()
    except OSError as e:  # a full disk or a vanished directory while writing metrics, plots or the summary
        if isinstance(e, FileNotFoundError) and not Path(cfg.out).is_dir():
            raise RunDirError(f"--out {cfg.out} disappeared during the run") from None
        where = f" ({e.filename})" if e.filename else ""
        raise RunDirError(f"writing the run in {cfg.out} failed: {e.strerror or e}{where}; "
                          f"its checkpoints are intact (continue with --resume)") from None
    if "rank" in s:  # a non-zero rank of a multi-process run: rank 0 prints the summary
        return 0
    print()
    print(f"steps {s['steps']}{' (stopped by --time-budget)' if s['stopped_early'] else ''}")
    print(f"validation loss {s['val_loss']:.4f} nats/token (perplexity {s['val_ppl']:.1f})")
    print(f"unigram baseline {s['unigram_baseline']:.4f} nats/token -> {s['gain_over_unigram']:.3f} nats better")
    if s["maxvio_mean_last"] is not None:
        print(f"MaxVio (mean over MoE layers, last step, balance={s['balance']}): {s['maxvio_mean_last']:.3f}")
    print(f"model: {s['model_dir']}   metrics: {Path(cfg.out) / 'metrics.jsonl'}   plots: {Path(cfg.out) / 'loss.png'}")
    print(f"model format: {_model_format(Path(s['model_dir']), cfg.qat)}")
    print(f"sample: {s['sample']}")
    return 0


def _start_kernels_early(device: str) -> None:
    """On one GPU: pin the shipped autotune choices and start compiling the kernels ahead while the data and the
    model load (k3.ops.tuning; else it happens at the first KDA layer). Ranks of a multi-process run leave it to
    that first layer, on their own devices."""
    import os

    from k3.train.trainer import pick_device

    chosen = pick_device(device)
    if chosen.type == "cuda" and "LOCAL_RANK" not in os.environ:
        from k3.ops import tuning
        tuning.pin_for_device(chosen)


def _model_format(model_dir: Path, qat: bool) -> str:
    """What the exported model directory holds, read back from its config.json (and what --qat trained for)."""
    from k3.checkpoint.convert import config_experts_format
    from k3.config import K3Config

    config = K3Config.from_pretrained(model_dir)
    if config_experts_format(config) == "mxfp4":
        return f"{config.dtype} weights, routed experts MXFP4 (packed E2M1 + E8M0 scales, quantization_config)"
    text = f"{config.dtype} weights, routed experts unquantized (no quantization_config)"
    if qat:
        text += (f"; --qat trained them for MXFP4 (MXFP8 expert activations): `k3 convert {model_dir} "
                 f"{model_dir}-mxfp4 --experts mxfp4` writes that format, which then runs as trained")
    return text


def cmd_generate(a) -> int:
    import torch

    from k3.data import model_tokenizer
    from k3.model.decoder import K3ForCausalLM
    from k3.model.generate import stream_generate

    model_dir = Path(a.model)
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"--model {model_dir}: no config.json there (train one with `k3 train`)")
    if a.prompt_file is not None:
        a.prompt = _read_prompt_file(a.prompt_file)
    tokenizer = model_tokenizer(model_dir)
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


def _read_prompt_file(path: str) -> str:
    """`--prompt-file`: the whole file (UTF-8) is the prompt; `-` reads standard input."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CLIError(f"--prompt-file {path}: {e.strerror or e}") from None


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
    from k3.parallel.memory_plan import (GPU_MEMORY, bare_number_warning, format_plan, parse_bytes, plan_memory,
                                         smallest_fit)

    config = K3Config.from_pretrained(a.config) if a.config else K3Config.preset(a.preset)
    if a.gpu and any(x.split("=")[0] == "--gpu-memory" for x in a.argv):
        raise CLIError("give --gpu or --gpu-memory, not both")
    mem = GPU_MEMORY[a.gpu] if a.gpu else parse_bytes(a.gpu_memory)
    if not a.gpu and (warning := bare_number_warning(a.gpu_memory)) is not None:
        _warn("plan", warning)
    if a.mode == "serve":
        return _plan_serve(a, config, mem)
    if a.tp or a.dp_attention:
        raise CLIError("--tp and --dp-attention are serving layouts: add --serve")
    if a.gpus is None:
        raise CLIError("training plans need --gpus")
    kw = dict(mode=a.mode, seq_len=a.seq_len or 8192, batch=a.batch, optimizer=a.optimizer)
    p = plan_memory(config, a.gpus, mem, dp=a.dp, ep=a.ep, cp=a.cp, **kw)
    best = smallest_fit(config, mem, cp=a.cp, **kw)
    if a.json:
        row = lambda q: None if q is None else {"gpus": q.gpus, "dp": q.dp, "ep": q.ep, "cp": q.cp,
                                               "parts": q.parts, "total": q.total, "fits": q.fits}
        print(json.dumps({"plan": row(p), "smallest": row(best), "gpu_memory": mem}, indent=2))
    else:
        print(format_plan(p, best))
    return 0 if p.fits else 1


def _plan_serve(a, config, mem: int) -> int:
    """`k3 plan --serve`: the given GPU count (else the smallest that fits) in the chosen layout (else both)."""
    from k3.parallel.memory_plan import SERVE_LAYOUTS, format_serve, plan_serve, smallest_serve

    if a.cp or a.dp or a.batch:
        raise CLIError("--cp, --dp and --batch are training flags; serving takes --gpus, --tp, --dp-attention, --ep")
    context = a.seq_len or 131072
    layouts = ["dp-attention"] if a.dp_attention else (["tp"] if a.tp else list(SERVE_LAYOUTS))
    best = smallest_serve(config, mem, context, layout=layouts[0] if len(layouts) == 1 else None, tp=a.tp)
    gpus = a.gpus or (best.gpus if best else None)
    plans = [] if gpus is None else [plan_serve(config, gpus, mem, context, tp=a.tp or (best.tp if best and not a.gpus
                                                else None), layout=lay, ep=a.ep) for lay in layouts]
    if a.json:
        row = lambda q: None if q is None else {
            "gpus": q.gpus, "layout": q.layout, "tp": q.tp, "ep": q.ep, "parts": q.parts, "weight_bytes": q.weight_bytes,
            "cache_bytes": q.cache_bytes, "token_bytes": q.token_bytes, "sequence_bytes": q.sequence_bytes,
            "sequences": q.sequences, "tokens": q.tokens, "fits": q.fits}
        print(json.dumps({"context": context, "gpu_memory": mem, "plans": [row(p) for p in plans],
                          "smallest": row(best)}, indent=2))
    else:
        print(format_serve(plans, best))
    return 0 if plans and any(p.fits for p in plans) else 1


def cmd_info(a) -> int:
    from k3.config import K3Config
    from k3.info import format_report, model_report

    if a.verify and not a.dir:
        raise CLIError("--verify needs a checkpoint directory: k3 info DIR --verify")
    if a.dir:
        _check_info_path(Path(a.dir), a.verify)
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


def _check_info_path(path: Path, verify: bool) -> None:
    """`k3 info PATH` reads a checkpoint directory or a config.json; --verify needs the directory (a shard alone
    cannot be checked against the config: the other shards hold the rest of the plan)."""
    if not path.exists():
        raise CLIError(f"{path}: no such file or directory")
    if path.is_dir():
        return
    if verify:
        raise CLIError(f"{path} is a file; --verify checks a whole checkpoint directory (config.json + safetensors "
                       f"shards) against its config: k3 info {path.parent} --verify")
    if path.suffix != ".json":
        raise CLIError(f"{path} is not a config.json; give a checkpoint directory or its config.json "
                       f"(e.g. k3 info {path.parent})")


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


def cmd_init(a) -> int:
    from k3.checkpoint.random_init import write_random_checkpoint
    from k3.config import K3Config

    config = K3Config.from_pretrained(a.config) if a.config else K3Config.preset(a.preset)
    if a.num_experts is not None:
        if a.num_experts < config.num_experts_per_token:
            raise CLIError(f"--num-experts {a.num_experts} is below the top-k of {config.num_experts_per_token}")
        config = config.replace(num_experts=a.num_experts)
    r = write_random_checkpoint(config, a.out, a.experts_format, seed=a.seed, max_shard_bytes=a.shard_size,
                                device=a.device, workers=a.workers, progress=True)
    print(f"wrote {a.out}: {r['tensors']:,} tensors, {r['bytes']:,} B in {r['shards']} shards "
          f"({a.experts_format} experts)")
    return 0


def cmd_tune(a) -> int:
    import torch

    from k3.ops import tuning

    if not torch.cuda.is_available():
        raise CLIError("needs a CUDA GPU: the choices it writes are that GPU's")
    table = a.table or str(tuning.TABLE_PATH)
    gpu, kernels = tuning.tune(a.preset, a.batch_size, a.seq_len, table, autocast=a.autocast)
    print(f"wrote the autotune choices of {kernels} kernels for {gpu} to {table}")
    return 0


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


def _concurrency_levels(s: str) -> list[int]:
    """'1,8,32' → [1, 8, 32]; '' → [] (no concurrency cap: arrivals paced by --request-rate)."""
    try:
        levels = [int(x) for x in s.split(",")] if s.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,8,32, got {s!r}") from None
    bad = [v for v in levels if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {bad[0]}")
    return levels


def _datasets(s: str) -> list[str]:
    from k3.serve.bench import DATASETS

    names = [x.strip() for x in s.split(",")]
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dataset {unknown[0]!r}; choose from {', '.join(DATASETS)} "
                                         f"(comma-separated)")
    return names


def _output_file(s: str) -> Path:
    """A file path the command can write later: checked now, so a long run cannot fail at its first write."""
    import os
    path = Path(s)
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{s} is a directory; give a file name, e.g. {path / 'results.json'}")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: the directory {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{s}: not writable (permission denied)")
    return path


def _engine_config(a):
    from k3.serve.engine import EngineConfig

    config = EngineConfig(memory_bytes=int(a.memory_gib * 2**30), block_size=a.block_size, match_unit=a.match_unit,
                          max_batch_tokens=a.max_batch_tokens, max_num_seqs=a.max_num_seqs,
                          prefix_caching=not a.no_prefix_caching, async_output=a.async_output,
                          prefill_graphs=a.prefill_graphs, static_kda_cores=a.static_kda_cores)
    if a.block_size % a.match_unit:  # the engine's own rule, said in flags
        raise CLIError(f"--block-size {a.block_size} must be a multiple of --match-unit {a.match_unit}")
    config.validate()  # now, not once the model is loaded
    return config


def _add_engine_args(p: argparse.ArgumentParser, block: int, unit: int) -> None:
    p.add_argument("--memory-gib", type=_positive_float, default=1.0, help="KV pool + KDA state budget (GiB)")
    p.add_argument("--block-size", type=_positive_int, default=block, help="tokens per physical MLA block")
    p.add_argument("--match-unit", type=_positive_int, default=unit, help="prefix-hash granularity (divides block size)")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=8192, help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="concurrently running sequences")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--async-output", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before reading the previous one back (host work overlaps the device; "
                        "on by default, --no-async-output reads every step back before the next launches)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run prompt-chunk steps through piecewise CUDA graphs (one per token bucket, broken at the "
                        "mixers' cores; default: on CUDA from one process)")
    p.add_argument("--static-kda-cores", action=argparse.BooleanOptionalAction, default=None,
                   help="with prefill graphs: the KDA cores over a fixed-shape layout per token bucket, captured "
                        "with the pieces (only MLA's cores break them; default: where the KDA core is fla's lean "
                        "chunked one, i.e. 16-bit models on CUDA; --no-static-kda-cores breaks them at every core)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="one-device serving: the engine in a process of its own beside the HTTP server's (their "
                        "Python does not share one GIL; --no-engine-process: one process, the engine on a thread)")


def _check_max_model_len(model_dir: str, max_model_len: int | None) -> None:
    """--max-model-len past the model's positions: said now, before the model loads."""
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # serve() reports a missing or broken config.json itself
    if max_model_len is not None and isinstance(positions, int) and max_model_len > positions:
        raise CLIError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({positions})")


def _require_serve_extra(*modules: str) -> None:
    """Import `modules` (parts of the serve extra, or k3 modules built on it), or fail with one line naming the
    missing module and the extra: before any rank starts or a model loads."""
    import importlib
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError as e:  # e.name: the missing module, fastapi's own dependencies included
        raise CLIError(f"{e.name} is missing: install the serve extra (pip install 'k3[serve]')") from None


def cmd_serve(a) -> int:
    import os

    from k3.serve.distributed import is_torchrun_rank

    ranked = is_torchrun_rank()  # one rank of a group (torchrun, or started by `k3 serve --nproc N`)
    if not ranked or os.environ["RANK"] == "0":
        check_listen_address(a.host, a.port)  # a taken port: say so now, not after loading the model
    engine_config = _engine_config(a)
    engine_config.max_model_len = a.max_model_len
    _check_max_model_len(a.model, a.max_model_len)
    from k3 import envs
    api_key = a.api_key if a.api_key is not None else envs.current().api_key
    _require_serve_extra("uvicorn", "k3.serve.api")
    from k3.serve.api import check_api_key, serve
    if api_key is not None:  # before the model loads
        check_api_key(api_key, "--api-key" if a.api_key is not None else "$K3_API_KEY")
    if ranked or (a.nproc or 1) > 1 or (a.ep or 1) > 1 or a.tp > 1 or a.ep_replicas or a.ep_rebalance_steps:
        from k3.serve.distributed import RankFailure, serve_from_cli
        try:
            serve_from_cli(a, engine_config, api_key)
        except RankFailure as e:
            raise CLIError(str(e)) from None
        return 0
    serve(a.model, host=a.host, port=a.port, api_key=api_key, engine_config=engine_config,
          model_name=a.served_model_name, device=a.device, max_request_bytes=a.max_request_bytes,
          timeout_keep_alive=a.timeout_keep_alive, header_timeout=a.header_timeout,
          limit_concurrency=a.limit_concurrency, engine_process=a.engine_process)
    return 0


def cmd_bench_serve(a) -> int:
    import dataclasses
    import functools
    import time

    import torch

    from k3.data import Tokenizer, model_tokenizer
    from k3.serve import bench

    if a.quick:  # a small CPU-sized sanity run of every path: engine (both datasets), baseline, checks
        a.concurrency, a.num_prompts, a.prompts_per_concurrency = [1, 4], 2, 2
        a.input_len, a.output_len, a.turns, a.request_rate = 16, 8, 2, None
    # every flag is checked by now (argparse types) but the engine's own rules: before the model and the warm-up
    engine_config = dataclasses.replace(_engine_config(a), num_state_slots=a.num_state_slots)
    if a.model and not (Path(a.model) / "config.json").is_file():
        raise CLIError(f"--model {a.model}: no config.json there")
    _require_serve_extra("aiohttp", "k3.serve.api")  # the load's client, the HTTP server it drives
    torch.manual_seed(a.seed)
    # On a shared CPU, OpenMP spin-waiting across threads can slow small ops 10x; one thread is steadier.
    torch.set_num_threads(a.threads or (1 if a.device == "cpu" else torch.get_num_threads()))
    tokenizer = model_tokenizer(Path(a.model)) if a.model else Tokenizer.from_file()
    make_model = functools.partial(bench.make_model, a.model, a.preset, a.seed, a.device, a.dtype)
    model = make_model()
    levels = a.concurrency or [None]
    datasets = a.dataset
    rows, problems = [], []
    t_start = time.perf_counter()

    def record(name: str, s: dict) -> None:
        rows.append((name, s))
        problems.extend(f"{name}: {p}" for p in s["problems"])
        print(f"{bench.format_table(rows[-1:]).splitlines()[-1]}  ({time.perf_counter() - t_start:.0f} s)",
              flush=True)
        if "engine" in s:
            print(f"  {bench.format_engine_summary(s['engine'])}", flush=True)
        if "profile" in s:
            print(s["profile"], flush=True)
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
                                     a.output_len, a.turns, a.seed, warmup=True,
                                     make_model=make_model if a.engine_process else None,
                                     profile_top=a.profile_engine)
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
    from importlib.metadata import version

    from k3 import __version__
    from k3.config import K3Config

    p = _Parser(prog="k3", description="Kimi K3 from scratch: build, train, generate, inspect.")
    p.add_argument("--version", action="version",
                   version=f"k3 {__version__} (torch {version('torch')}, Python {sys.version.split()[0]})")
    sub = p.add_subparsers(dest="command", required=True)
    # train and bench build the model in memory: the 94B-parameter k3-shaped preset is for init, plan and info
    presets = dict(type=_preset, metavar="{" + ",".join(p for p in K3Config.PRESETS if p != "k3-shaped") + "}",
                   help="model size")
    every_preset = dict(presets, metavar="{" + ",".join(K3Config.PRESETS) + "}")

    t = sub.add_parser("train", help="train a K3 on the bundled corpus (defaults: tiny preset, ~10 min on 2 CPU cores)")
    t.add_argument("--task", choices=["text", "vision"], default="text",
                   help="text: the bundled corpus; vision: a tiny vision-language model on synthetic scenes "
                        "(defaults then: --out runs/vision --max-steps 400 --batch-size 16 --lr 3e-3)")
    t.add_argument("--preset", default="tiny", **presets)
    t.add_argument("--out", default=None,
                   help="run directory: checkpoints, metrics, plots, model (default: runs/PRESET; runs/vision for "
                        "--task vision). A new run needs it missing or empty")
    t.add_argument("--corpus", default=None, help="a .jsonl.xz corpus (default: bundled Shakespeare)")
    t.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="OpenAI-format conversations ({'messages', 'tools'} a line) instead of the corpus: rendered "
                        "in K3's chat markup, the loss on the assistant's tokens only")
    t.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: bundled BPE)")
    t.add_argument("--max-steps", type=_positive_int, default=300, help="optimizer steps")
    t.add_argument("--time-budget", type=_positive_float, default=None, help="seconds; stop early, then evaluate and save")
    t.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per micro-batch")
    t.add_argument("--seq-len", type=_positive_int, default=256, help="tokens per sequence")
    t.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=_positive_float, default=0.01, help="peak learning rate (WSD schedule)")
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    t.add_argument("--balance", choices=["quantile", "sign", "none"], default="quantile")
    t.add_argument("--eval-every", type=_positive_int, default=50, help="steps between validation passes")
    t.add_argument("--save-every", type=_positive_int, default=100, help="steps between checkpoints")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", type=_device_or_auto, default="auto", help="cpu, cuda, cuda:N; auto: cuda if present")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest good checkpoint, with its saved settings")
    t.add_argument("--overwrite", action="store_true",
                   help="start a new run in --out, deleting the previous run there (never other files)")
    t.add_argument("--qat", action="store_true",
                   help="quantization-aware training: MXFP4 routed-expert weights, MXFP8 expert activations")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each decoder layer's inputs and recompute the layer in backward "
                        "(far less activation memory, about one more forward of compute)")
    t.add_argument("--compile", action="store_true",
                   help="run the KDA, MLA, MoE and dense MLP layers' training forwards through torch.compile "
                        "(one compile per layer kind at the first step)")
    t.add_argument("--nproc", type=_positive_int, default=1, help="processes to launch through torchrun")
    t.add_argument("--dp", type=_positive_int, default=None, help="data parallel size (default nproc / cp)")
    t.add_argument("--ep", type=_positive_int, default=1, help="expert parallel size (divides dp × cp and the experts)")
    t.add_argument("--cp", type=_positive_int, default=1, help="context parallel size (KDA state scan, MLA KV gather)")
    t.add_argument("--fsdp", action="store_true",
                   help="FSDP2: shard the non-expert parameters and their optimizer state over all processes")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="per-GPU memory of a training or serving layout; smallest GPU count that fits")
    pl.add_argument("--preset", default="kimi-k3", **every_preset)
    pl.add_argument("--config", default=None, help="a config.json (or its directory) instead of --preset")
    pl.add_argument("--gpus", type=_positive_int, default=None,
                    help="GPU count (training: required; serving: default the smallest that fits)")
    pl.add_argument("--gpu", choices=["h200", "b200"], default=None, help="card: h200 (141 GB) or b200 (192 GB)")
    pl.add_argument("--gpu-memory", default="141GB",
                    help="per GPU: 141GB (10^9 B), 80GiB (2^30 B), ...; a bare number is bytes")
    pl.add_argument("--mode", choices=["train", "serve"], default="train")
    pl.add_argument("--serve", dest="mode", action="store_const", const="serve",
                    help="plan serving (= --mode serve): weights, GPU count, layout, KV and KDA-state capacity")
    pl.add_argument("--tp", type=_positive_int, default=None,
                    help="serving: tensor parallel size of the dense weights (default: 8, 4, 2 or 1, what divides)")
    pl.add_argument("--dp-attention", action="store_true",
                    help="serving: every GPU keeps all attention weights and serves its own sequences")
    pl.add_argument("--dp", type=_positive_int, default=None)
    pl.add_argument("--ep", type=_positive_int, default=None, help="default gcd(gpus, experts)")
    pl.add_argument("--cp", type=_positive_int, default=None)
    pl.add_argument("--seq-len", "--context", dest="seq_len", type=_positive_int, default=None,
                    help="training sequence length (default 8192) / serving context (default 131072)")
    pl.add_argument("--batch", type=_positive_int, default=None, help="global sequences (default: one per dp rank)")
    pl.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="generate text from a trained model directory")
    g.add_argument("--model", required=True, help="a directory written by `k3 train` (e.g. runs/tiny/model)")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file (- for stdin); "
                        "long prompts are prefilled in memory-bounded chunks")
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
    i.add_argument("--preset", default="kimi-k3", **every_preset)
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

    ini = sub.add_parser("init", help="write a randomly initialised model in the released layout, shard by shard "
                                      "(never the whole model in memory)")
    ini.add_argument("--preset", default="k3-shaped", **every_preset)
    ini.add_argument("--config", default=None, help="a config.json instead of --preset")
    ini.add_argument("--experts-format", choices=["mxfp4", "bf16"], default="mxfp4")
    ini.add_argument("--num-experts", type=_positive_int, default=None,
                     help="routed experts per layer instead of the config's (k3-shaped with all 896: 57.6 GB)")
    ini.add_argument("--out", required=True, help="a new or empty directory")
    ini.add_argument("--seed", type=int, default=0)
    ini.add_argument("--shard-size", type=_size, default=5 * 2**30, help="largest shard, e.g. 5G (default), 500M")
    ini.add_argument("--device", type=_device, default="cpu", help="where expert matrices are packed (cuda: fast)")
    ini.add_argument("--workers", type=_positive_int, default=1,
                     help="shards made at once (threads; each holds one shard in memory)")
    ini.set_defaults(func=cmd_init)

    tu = sub.add_parser("tune", help="autotune the GPU kernels on one training step of this GPU and write their "
                                     "choices, which later runs pin instead of autotuning (k3.ops.tuning)")
    tu.add_argument("--preset", default="small", **presets)
    tu.add_argument("--batch-size", type=_positive_int, default=8)
    tu.add_argument("--seq-len", type=_positive_int, default=4096)
    tu.add_argument("--autocast", action="store_true",
                    help="tune the step as `k3 train` runs it, fp32 weights under bf16 autocast (default: bf16 weights, "
                         "as the GPU benchmarks)")
    tu.add_argument("--table", default=None, help="the table file: this GPU's choices are added to it (a key tuned "
                    "again is replaced), other GPUs' kept (default: the one k3 ships, k3/ops/autotune_table.json)")
    tu.set_defaults(func=cmd_tune)

    sv = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API")
    sv.add_argument("--model", required=True, help="a model directory (config.json + safetensors)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=tcp_port, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but the "
                    "probes (/health, /ping, /version, /metrics); default: $K3_API_KEY")
    sv.add_argument("--max-model-len", type=_positive_int, default=None,
                    help="prompt + max_tokens limit (default: the model's max_position_embeddings, capped by the pool)")
    sv.add_argument("--max-request-bytes", type=_size, default=64 * 2**20, help="largest request body, e.g. 64M")
    sv.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0,
                    help="seconds an idle keep-alive connection is held open")
    sv.add_argument("--header-timeout", type=_positive_float, default=10.0,
                    help="seconds a connection may take to send a request's line and headers (slow or silent "
                         "clients are cut off, with a 408 if they sent part of one)")
    sv.add_argument("--limit-concurrency", type=_positive_int, default=1024,
                    help="open connections + running requests past which a request gets a 503")
    sv.add_argument("--served-model-name", default=None, help="model id clients use (default: directory name)")
    sv.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N")
    sv.add_argument("--nproc", type=_positive_int, default=None,
                    help="ranks on this machine, one engine in lockstep (gloo on CPU, NCCL on GPU); under torchrun "
                         "the launcher's WORLD_SIZE")
    sv.add_argument("--ep", type=_positive_int, default=None,
                    help="ranks that share one copy of the routed experts (divides the ranks; default all of them)")
    sv.add_argument("--tp", type=_positive_int, default=1, help="ranks that split attention and dense parts by heads")
    sv.add_argument("--ep-replicas", type=_positive_int, default=None,
                    help="other ranks' experts each EP rank also holds per MoE layer, placed from the routed load so "
                         "that hot experts' slots are split between ranks (balanced expert parallelism)")
    sv.add_argument("--ep-rebalance-steps", type=_positive_int, default=None,
                    help="engine steps between re-placements of the --ep-replicas (default 256)")
    _add_engine_args(sv, block=2048, unit=512)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("serve", help="load-test the serving engine over HTTP (TTFT, TPOT, ITL, e2e, hit rate)")
    bs.add_argument("--model", default=None, help="a model directory (default: a random --preset model)")
    bs.add_argument("--preset", default="tiny", **presets)
    bs.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N")
    bs.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    bs.add_argument("--concurrency", type=_concurrency_levels, default="1,8,32",
                    help="comma-separated max concurrency levels ('' for none: --request-rate paces arrivals)")
    bs.add_argument("--request-rate", type=_positive_rate, default=None,
                    help="Poisson arrivals per second (inf: all at once)")
    bs.add_argument("--dataset", type=_datasets, default="random,multiturn", help="random and/or multiturn")
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
    bs.add_argument("--json", type=_output_file, default=None, help="write the results to this file (after every row)")
    bs.add_argument("--profile-engine", type=_positive_int, default=0, metavar="N",
                    help="run each engine row's timed load with the engine's steps under cProfile and print its top "
                         "N functions (by own and by cumulative time; the row's figures are then not comparable)")
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


def _command_name(args) -> str:
    """'k3 train', 'k3 bench serve', 'k3 agentenv run': the prefix of every error line."""
    subcommands = [getattr(args, sub) for sub in ("bench", "agentenv") if getattr(args, sub, None)]
    return " ".join(["k3", args.command, *subcommands])


def _error_line(e: Exception) -> str:
    """One line for a user's problem: an OSError names its path and the system's reason, not its errno tuple."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e).strip().replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed --help, --version or its error line
        return e.code if isinstance(e.code, int) else 2
    from k3.agentenv.api import BackendUnavailable
    from k3.checkpoint.hf import CheckpointError
    from k3.config import ConfigError
    from k3.data import CorpusError, TokenizerError

    # the one exit path for problems a user can fix: `k3 <command>: error: <one line>`, exit 2
    user_errors = (CLIError, ConfigError, CorpusError, TokenizerError, CheckpointError, BackendUnavailable,
                   FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, ValueError)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # `k3 train` tells given flags from defaults
    try:
        if args.command not in ("plan", "agentenv"):  # the commands that run torch: threads fit the free cores
            from k3.cpu_threads import configure_torch_threads
            configure_torch_threads()
        return args.func(args)
    except user_errors as e:
        print(f"{_command_name(args)}: error: {_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_command_name(args)}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
