"""`k3 train --task vision`: trains a tiny MoonViT tower + projector + tiny K3 jointly on the synthetic scenes
(k3.vision.synthetic) on CPU in minutes, then reports answer accuracy on fresh in-distribution scenes and on
the held-out split, whose colour-shape combinations never appeared in training."""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3.balance import ExpertBalancer
from k3.config import K3Config
from k3.data import Tokenizer
from k3.train.optim import build_optimizer
from k3.vision import synthetic as syn
from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration, image_token_ids
from k3.vision.preprocess import ImageInput, batch_images, preprocess_image


@dataclass
class VisionTrainConfig:
    out: str = "runs/vision"
    max_steps: int = 400
    time_budget: float | None = None   # seconds
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    text_layers: int = 4
    eval_scenes: int = 200
    eval_every: int = 100
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        for name in ("max_steps", "batch_size", "text_layers", "eval_scenes", "eval_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget!r}")


def build_tiny_vlm(tokenizer: Tokenizer, text_layers: int = 4) -> K3ForConditionalGeneration:
    """The tiny preset's K3 shape (width 128, 16 experts) with `text_layers` layers + the tiny vision preset."""
    full = sorted({l for l in range(1, text_layers + 1) if l % 4 == 0} | {text_layers})
    text = K3Config.preset("tiny").replace(
        num_hidden_layers=text_layers, attn_res_block_size=2,
        linear_attn_config={"full_attn_layers": full,
                            "kda_layers": [l for l in range(1, text_layers + 1) if l not in full]})
    vision = VisionConfig.preset("tiny", text_hidden_size=text.hidden_size)
    return K3ForConditionalGeneration(text, vision, tokenizer.special_tokens["<|media_pad|>"])


class Examples:
    """Encodes (image, question, answer) triples into padded training rows; only answer tokens are learned."""

    def __init__(self, tokenizer: Tokenizer, vision_config: VisionConfig):
        self.tok, self.vcfg = tokenizer, vision_config
        self.sep = tokenizer.special_tokens["<|sep|>"]

    def encode(self, image: ImageInput, qas: list[tuple[str, str]]) -> tuple[list[int], list[tuple[int, int]]]:
        """image, then `question<|sep|> answer<|end_of_msg|>` for each pair → (ids, [(answer start, end)])."""
        ids = [self.tok.bos_id, *image_token_ids(self.tok, image)]
        spans = []
        for q, a in qas:
            ids += [*self.tok.encode(" " + q), self.sep]
            start = len(ids)
            ids += [*self.tok.encode(" " + a), self.tok.eos_id]
            spans.append((start, len(ids)))
        return ids, spans

    def batch(self, items: list[tuple[ImageInput, list[tuple[str, str]]]]):
        """→ dict(input_ids [B, T], labels [B, T] (targets, shifted), mask [B, T], pixel_values, grid_thws)."""
        rows = [self.encode(im, qas) for im, qas in items]
        T = max(len(ids) for ids, _ in rows) - 1
        pad = self.tok.pad_id
        input_ids = torch.full((len(rows), T), pad, dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for i, (ids, spans) in enumerate(rows):
            n = len(ids) - 1
            input_ids[i, :n] = torch.tensor(ids[:-1])
            mask[i, :n] = True
            for s, e in spans:  # only answers (and their end token) are learned
                labels[i, s - 1:e - 1] = torch.tensor(ids[s:e])
        pv, grid = batch_images([im for im, _ in items])
        return {"input_ids": input_ids, "labels": labels, "mask": mask, "pixel_values": pv, "grid_thws": grid}


def _scene_image(scene, rng, vcfg) -> ImageInput:
    return preprocess_image(syn.render(scene, rng), vcfg)


def train_items(rng: random.Random, n: int, vcfg, per_image: int = 6) -> list[tuple[ImageInput, list]]:
    """n training scenes, each with `per_image` questions (several answers per image: more signal per step)."""
    items = []
    for _ in range(n):
        scene = syn.sample_scene(rng, "train")
        kinds = rng.choices(syn.QUESTION_KINDS, weights=(3, 3, 1, 1, 0.5), k=per_image)
        qas = [syn.question(scene, kind, rng.randrange(2)) for kind in kinds]
        items.append((_scene_image(scene, rng, vcfg), qas))
    return items


def eval_items(seed: int, n: int, split: str, vcfg) -> dict[str, list]:
    """Fixed evaluation questions. heldout: colour/shape questions about the never-seen combination."""
    rng = random.Random(seed)
    out = {"colour_of_shape": [], "shape_of_colour": []} if split == "heldout" else \
        {k: [] for k in syn.QUESTION_KINDS if k != "caption"}
    for _ in range(n):
        scene = syn.sample_scene(rng, split)
        image = _scene_image(scene, rng, vcfg)
        obj = syn.held_out_object(scene) if split == "heldout" else rng.randrange(2)
        for kind in out:
            out[kind].append((image, [syn.question(scene, kind, obj)]))
    return out


@torch.no_grad()
def accuracy(model, examples: Examples, items, batch_size: int = 64) -> float:
    """Exact-match answer accuracy: every answer token (and the end token) is the argmax, teacher-forced,
    which is what greedy decoding of the answer would produce."""
    model.eval()
    correct = 0
    for i in range(0, len(items), batch_size):
        b = examples.batch(items[i:i + batch_size])
        logits = model(b["input_ids"], b["pixel_values"], b["grid_thws"], mask=b["mask"]).logits
        ok = (logits.argmax(-1) == b["labels"]) | (b["labels"] == -100)
        correct += int(ok.all(-1).sum())
    model.train()
    return correct / len(items)


def evaluate(model, examples, sets) -> dict:
    return {split: {kind: accuracy(model, examples, items) for kind, items in kinds.items()}
            for split, kinds in sets.items()}


def run(cfg: VisionTrainConfig, log=print) -> dict:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tok = Tokenizer.from_file()
    model = build_tiny_vlm(tok, cfg.text_layers).to(cfg.device)
    model.language_model.reset_parameters(seed=cfg.seed)
    model.reset_vision_parameters(seed=cfg.seed)
    vcfg = model.vision_config
    examples = Examples(tok, vcfg)
    opt = build_optimizer(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    balancer = ExpertBalancer(model, mode="quantile")
    sets = {"in_distribution": eval_items(cfg.seed + 1, cfg.eval_scenes // 2, "train", vcfg),
            "heldout": eval_items(cfg.seed + 2, cfg.eval_scenes, "heldout", vcfg)}
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny VLM: {n_params:,} parameters (vision {sum(p.numel() for p in model.vision_tower.parameters()):,} + "
        f"projector {sum(p.numel() for p in model.mm_projector.parameters()):,}); "
        f"held-out combinations: {', '.join(f'{c} {s}' for c, s in sorted(syn.HELD_OUT))}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "w")
    t0, step, stopped_early = time.perf_counter(), 0, False
    model.train()
    while step < cfg.max_steps:
        if cfg.time_budget is not None and time.perf_counter() - t0 > cfg.time_budget:
            stopped_early = True
            break
        lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps)) * \
            (0.5 * (1 + math.cos(math.pi * step / cfg.max_steps)) * 0.9 + 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        b = examples.batch(train_items(rng, cfg.batch_size, vcfg))
        loss = model(b["input_ids"], b["pixel_values"], b["grid_thws"], labels=b["labels"], mask=b["mask"]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        balancer.observe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.step()
        step += 1
        rec = {"step": step, "loss": loss.item(), "lr": lr, "time": time.perf_counter() - t0}
        if step % cfg.eval_every == 0 and step < cfg.max_steps:
            rec["eval"] = evaluate(model, examples, sets)
            log(f"step {step}: loss {rec['loss']:.3f}  {_fmt(rec['eval'])}  ({rec['time']:.0f} s)", flush=True)
        elif step % 10 == 0:
            log(f"step {step}: loss {rec['loss']:.3f}  ({rec['time']:.0f} s)")
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
    final = evaluate(model, examples, sets)
    metrics.close()
    model.save_pretrained(out / "model", dtype=None)
    tok.backend.save(str(out / "model" / "tokenizer.json"))
    summary = {"steps": step, "stopped_early": stopped_early, "seconds": time.perf_counter() - t0,
               "accuracy": final, "heldout_accuracy": _mean(final["heldout"]),
               "in_distribution_accuracy": _mean(final["in_distribution"]), "model_dir": str(out / "model"),
               "config": asdict(cfg)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _mean(d: dict) -> float:
    return sum(d.values()) / len(d)


def _fmt(ev: dict) -> str:
    return "  ".join(f"{split} " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) for split, kinds in ev.items())
