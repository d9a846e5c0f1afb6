"""The `k3` command: train | generate | info."""
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


def cmd_train(a) -> int:
    from k3.train.trainer import TrainConfig, Trainer

    cfg = TrainConfig(preset=a.preset, out=a.out, corpus=a.corpus, tokenizer=a.tokenizer, max_steps=a.max_steps,
                      time_budget=a.time_budget, batch_size=a.batch_size, seq_len=a.seq_len,
                      grad_accum=a.grad_accum, lr=a.lr, optimizer=a.optimizer, balance=a.balance,
                      eval_every=a.eval_every, save_every=a.save_every, seed=a.seed, resume=a.resume,
                      device=a.device, warmup_steps=a.warmup_steps)
    from k3.config import K3Config
    K3Config.preset(cfg.preset)  # unknown preset: fail before loading data
    s = Trainer(cfg).run()
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
    model = K3ForCausalLM.from_pretrained(model_dir)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CLIError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
    ids = tokenizer.encode(a.prompt, add_bos=True)
    stream = tokenizer.decode_stream(skip_special_tokens=True)
    sys.stdout.write(a.prompt)
    sys.stdout.flush()
    for tok in stream_generate(model, torch.tensor([ids]), max_new_tokens=a.max_new_tokens,
                               temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                               eos_token_id=tokenizer.eos_id):
        t = int(tok[0])
        if t == tokenizer.eos_id:
            break
        sys.stdout.write(stream.step(t))
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_info(a) -> int:
    from k3.config import K3Config
    from k3.info import format_report, model_report

    if a.dir:
        config, name = K3Config.from_pretrained(a.dir), str(a.dir)
    else:
        config, name = K3Config.preset(a.preset), a.preset
    report = model_report(config)
    print(json.dumps(report, indent=2) if a.json else format_report(name, config, report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 from scratch: build, train, generate, inspect.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a K3 on the bundled corpus (defaults: tiny preset, ~10 min on 2 CPU cores)")
    t.add_argument("--preset", default="tiny")
    t.add_argument("--out", default="runs/tiny", help="run directory (checkpoints, metrics, plots, model)")
    t.add_argument("--corpus", default=None, help="a .jsonl.xz corpus (default: bundled Shakespeare)")
    t.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: bundled BPE)")
    t.add_argument("--max-steps", type=_positive_int, default=300)
    t.add_argument("--time-budget", type=_positive_float, default=None, help="seconds; stop early, then evaluate and save")
    t.add_argument("--batch-size", type=_positive_int, default=16)
    t.add_argument("--seq-len", type=_positive_int, default=256)
    t.add_argument("--grad-accum", type=_positive_int, default=1)
    t.add_argument("--lr", type=_positive_float, default=0.02)
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    t.add_argument("--balance", choices=["quantile", "sign", "none"], default="quantile")
    t.add_argument("--eval-every", type=_positive_int, default=50)
    t.add_argument("--save-every", type=_positive_int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="generate text from a trained model directory")
    g.add_argument("--model", required=True, help="a directory written by `k3 train` (e.g. runs/tiny/model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="parameter breakdown, activated parameters, cache and checkpoint sizes")
    i.add_argument("dir", nargs="?", default=None, help="a checkpoint directory (reads its config.json)")
    i.add_argument("--preset", default="kimi-k3")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
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
