"""`k3 train --task vision`: trains a tiny MoonViT tower + projector + tiny K3 jointly on the synthetic scenes
(k3.vision.synthetic) on CPU in minutes, then reports answer accuracy on fresh in-distribution scenes and on
the held-out split, whose colour-shape combinations never appeared in training.

Why it is shaped like this (each choice bought learning speed on 2 CPU cores):
- every image is encoded once and asked several questions, one question per row: rows are short, the tower
  runs once per image, and no row can answer a question by copying an earlier answer about the same image
  (which would teach the text model to ignore the picture);
- the loss and the logits are computed at the answer tokens only (the 8k-vocabulary head over every prompt
  position was a large part of a step and carried no signal);
- the image rows are kept from collapsing onto one shared vector, which is what blocked reading the image:
  at init ~70 % of every projector row is one vector common to all images (GELU's positive mean through the
  output layer), and within ~10 steps at the text model's lr the tower and projector made the rows identical
  (shared fraction 0.96 → 1.00) because every early gradient asks for the same thing (the answer vocabulary).
  So the recipe (not the SPEC math) (1) removes the mean hidden activation from the projector's output layer
  at init (`centre_projector`), (2) adds `centring_weight` × the shared fraction of the batch's rows to the
  loss, and (3) trains the tower and projector at `vision_lr_scale` = 0.1 × the text lr."""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3.balance import ExpertBalancer
from k3.config import K3Config
from k3.data import Tokenizer
from k3.ops.cross_entropy import cross_entropy
from k3.train.optim import build_optimizer
from k3.train.run_dir import check_run_dir, claim_run_dir, clear_previous_run
from k3.vision import synthetic as syn
from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration, image_token_ids
from k3.vision.preprocess import ImageInput, batch_images, preprocess_image

# Training question mix: (kind, weight). Colour/shape questions carry the binding the held-out split tests.
TRAIN_KINDS = (("colour_of_shape", 3.0), ("shape_of_colour", 3.0), ("side_of_shape", 1.0), ("digit", 1.0))
EVAL_KINDS = ("colour_of_shape", "shape_of_colour", "side_of_shape", "digit")
HELDOUT_KINDS = ("colour_of_shape", "shape_of_colour")


@dataclass
class VisionTrainConfig:
    out: str = "runs/vision"
    max_steps: int = 400
    time_budget: float | None = None   # seconds
    batch_size: int = 16               # images per step
    questions_per_image: int = 4       # rows per image (one question each)
    lr: float = 3e-3                   # text model (AdamW); the tower and projector get lr × vision_lr_scale
    vision_lr_scale: float = 0.1       # the tower and projector: at 1.0 their rows collapse
    warmup_steps: int = 30
    weight_decay: float = 0.01
    text_layers: int = 2
    full_attention: bool = False       # every text layer full attention (MLA) instead of the KDA pattern
    eval_scenes: int = 200
    eval_every: int = 100
    centre_projector: bool = True      # start the projector with image rows centred over the training images
    centring_weight: float = 1.0       # loss weight keeping the batch-mean image row near zero (0 = off)
    seed: int = 0
    device: str = "cpu"
    overwrite: bool = False            # a non-empty `out` is refused unless it holds only a previous run to replace

    def validate(self) -> None:
        for name in ("max_steps", "batch_size", "questions_per_image", "text_layers", "eval_scenes", "eval_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.centring_weight, (int, float)) and self.centring_weight >= 0
                and math.isfinite(self.centring_weight)):
            raise ValueError(f"--centring-weight must be a number >= 0, got {self.centring_weight!r}")
        for name in ("lr", "vision_lr_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"--time-budget must be > 0 seconds, got {self.time_budget!r}")


def build_tiny_vlm(tokenizer: Tokenizer, text_layers: int = 2, full_attention: bool = False) -> K3ForConditionalGeneration:
    """The tiny preset's K3 shape (width 128, 16 experts) with `text_layers` layers + the tiny vision preset.
    Layers follow the K3 pattern (KDA, every 4th and the last full attention) unless `full_attention`."""
    full = sorted({l for l in range(1, text_layers + 1) if l % 4 == 0 or full_attention} | {text_layers})
    text = K3Config.preset("tiny").replace(
        num_hidden_layers=text_layers, attn_res_block_size=2,
        linear_attn_config={"full_attn_layers": full,
                            "kda_layers": [l for l in range(1, text_layers + 1) if l not in full]})
    vision = VisionConfig.preset("tiny", text_hidden_size=text.hidden_size)
    return K3ForConditionalGeneration(text, vision, tokenizer.special_tokens["<|media_pad|>"])


class Examples:
    """Encodes (image, question, answer) triples into padded rows; only answer tokens are learned."""

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

    def shared_batch(self, images: list[ImageInput], rows: list[tuple[int, tuple[str, str]]]):
        """Several one-question rows per image, each image encoded once.
        images: the step's images; rows: (image index, (question, answer)) → dict(input_ids [R, T],
        labels [R, T], mask [R, T], pixel_values [N, 3, P, P] and grid_thws [n, 3] of `images`,
        image_index [R·tokens] (which merged-token row of the encoded images fills each pad, in order))."""
        b = self.batch([(images[i], [qa]) for i, qa in rows])
        pv, grid = batch_images(images)
        counts = [im.num_tokens for im in images]
        starts = [sum(counts[:i]) for i in range(len(images))]
        index = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i, _ in rows])
        return {**b, "pixel_values": pv, "grid_thws": grid, "image_index": index}


def answer_logits(model: K3ForConditionalGeneration, batch: dict, return_rows: bool = False):
    """The text model's logits at the supervised positions only → (logits [S, vocab], targets [S])
    (+ the encoded image rows [M, D] with return_rows). With `image_index` each image is encoded once and its
    rows are reused by every row asking about it."""
    image_rows = model.encode_images(batch["pixel_values"], batch["grid_thws"])
    encoded = image_rows
    if "image_index" in batch:
        image_rows = image_rows[batch["image_index"].to(image_rows.device)]
    dev = image_rows.device
    input_ids, labels = batch["input_ids"].to(dev), batch["labels"].to(dev)
    embeds = model.splice(input_ids, image_rows)
    hidden = model.language_model.model(input_ids, mask=batch["mask"].to(dev), inputs_embeds=embeds)
    keep = labels != -100
    if return_rows:
        return model.lm_head(hidden[keep]), labels[keep], encoded
    return model.lm_head(hidden[keep]), labels[keep]


def shared_row_fraction(image_rows: torch.Tensor) -> torch.Tensor:
    """image_rows: [M, D] → ‖mean row‖² / mean ‖row‖² in [0, 1]: the share of one common vector."""
    return image_rows.mean(0).pow(2).sum() / image_rows.pow(2).sum(-1).mean().clamp_min(1e-12)


@torch.no_grad()
def centre_projector(model: K3ForConditionalGeneration, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> None:
    """Removes the mean hidden activation's image from the projector's output layer, so the rows of these
    images start centred. Why: at init GELU's positive mean makes ~70 % of every row's energy one vector shared
    by all images, which the text model's RMSNorm then weighs against the per-image signal; with frozen random
    features the text model read the image only once the rows were centred. The projector's formula is unchanged.
    pixel_values: [N, 3, P, P]; grid_thws: [n, 3]."""
    from k3.vision.projector import merge_patches
    proj = model.mm_projector.proj
    feats = merge_patches(model.vision_tower(pixel_values, grid_thws), grid_thws)
    mu = proj[1](proj[0](feats)).mean(0)  # [mm_hidden]
    w = proj[2].weight  # [D, mm_hidden]
    w -= torch.outer(w @ mu, mu) / mu.pow(2).sum().clamp_min(1e-12)


def answer_loss(model: K3ForConditionalGeneration, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens (equal to `model(..., labels=...).loss`, without the head
    over every prompt position)."""
    logits, targets = answer_logits(model, batch)
    return cross_entropy(logits, targets)  # the model's own loss (fp64 stays fp64)


def _scene_image(scene, rng, vcfg) -> ImageInput:
    return preprocess_image(syn.render(scene, rng), vcfg)


def _sample_question(scene, rng: random.Random) -> tuple[str, str]:
    kind = rng.choices([k for k, _ in TRAIN_KINDS], weights=[w for _, w in TRAIN_KINDS])[0]
    return syn.question(scene, kind, rng.randrange(2))


def train_batch(rng: random.Random, examples: Examples, n_images: int, per_image: int) -> dict:
    """n_images fresh training scenes, each asked `per_image` distinct questions, one per row."""
    images, rows = [], []
    for i in range(n_images):
        scene = syn.sample_scene(rng, "train")
        images.append(_scene_image(scene, rng, examples.vcfg))
        asked = set()
        for _ in range(20 * per_image):
            qa = _sample_question(scene, rng)
            if qa not in asked:
                asked.add(qa)
                rows.append((i, qa))
            if len(asked) == per_image:
                break
    return examples.shared_batch(images, rows)


def eval_items(seed: int, n: int, split: str, vcfg) -> dict[str, list]:
    """Fixed evaluation questions, one per row. heldout: colour/shape questions about the never-seen
    combination (the scene's other object may be a trained one)."""
    rng = random.Random(seed)
    out = {k: [] for k in (HELDOUT_KINDS if split == "heldout" else EVAL_KINDS)}
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
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(items), batch_size):
        b = examples.batch(items[i:i + batch_size])
        logits, targets = answer_logits(model, b)
        ok = (logits.argmax(-1) == targets).tolist()
        # answer tokens are row-major: split them back into rows
        per_row = (b["labels"] != -100).sum(-1).tolist()
        start = 0
        for n in per_row:
            correct += all(ok[start:start + n])
            start += n
    model.train(was_training)
    return correct / len(items)


def evaluate(model, examples, sets) -> dict:
    return {split: {kind: accuracy(model, examples, items) for kind, items in kinds.items()}
            for split, kinds in sets.items()}


def blind_baselines(seed: int, n: int = 20000) -> dict:
    """What a model that never looks at the image can score: per question, always the answer most often
    seen with that question in training. {"in_distribution": {kind: acc}, "heldout": {kind: acc}}.
    On the held-out split it scores 0 on colour and shape by construction (the true pairing never appeared)."""
    rng = random.Random(seed)
    seen: dict[str, Counter] = {}
    for _ in range(n):
        scene = syn.sample_scene(rng, "train")
        for kind in EVAL_KINDS:
            for obj in range(2):
                q, a = syn.question(scene, kind, obj)
                seen.setdefault(q, Counter())[a] += 1
    best = {q: c.most_common(1)[0][0] for q, c in seen.items()}
    out = {}
    for split, kinds in (("in_distribution", EVAL_KINDS), ("heldout", HELDOUT_KINDS)):
        hits = {k: 0 for k in kinds}
        for _ in range(2000):
            scene = syn.sample_scene(rng, "train" if split == "in_distribution" else "heldout")
            obj = rng.randrange(2) if split == "in_distribution" else syn.held_out_object(scene)
            for k in kinds:
                q, a = syn.question(scene, k, obj)
                hits[k] += best.get(q) == a
        out[split] = {k: v / 2000 for k, v in hits.items()}
    return out


def build_vision_optimizer(model, cfg: VisionTrainConfig) -> torch.optim.Optimizer:
    """AdamW; the tower and projector at lr × vision_lr_scale (their groups keep it in `lr_scale`)."""
    opt = build_optimizer(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    vision_ids = {id(p) for m in (model.vision_tower, model.mm_projector) for p in m.parameters()}
    groups = []
    for g in opt.param_groups:
        for is_vision in (False, True):
            params = [p for p in g["params"] if (id(p) in vision_ids) == is_vision]
            if params:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params,
                               "lr_scale": cfg.vision_lr_scale if is_vision else 1.0})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def lr_at(step: int, cfg: VisionTrainConfig) -> float:
    """Linear warmup, then cosine to 10 % of lr at max_steps."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, cfg.max_steps) / cfg.max_steps)))


def run(cfg: VisionTrainConfig, log=print) -> dict:
    cfg.validate()
    out = Path(cfg.out)
    check_run_dir(out, overwrite=cfg.overwrite)  # before the minutes of set-up: a used --out is refused now
    lock = claim_run_dir(out)  # noqa: F841 (held until this function returns: a second run on --out is refused)
    if cfg.overwrite:
        clear_previous_run(out)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tok = Tokenizer.from_file()
    model = build_tiny_vlm(tok, cfg.text_layers, cfg.full_attention).to(cfg.device)
    model.language_model.reset_parameters(seed=cfg.seed)
    model.reset_vision_parameters(seed=cfg.seed)
    vcfg = model.vision_config
    examples = Examples(tok, vcfg)
    if cfg.centre_projector:
        b = train_batch(random.Random(cfg.seed + 4), examples, 64, 1)
        centre_projector(model, b["pixel_values"].to(cfg.device), b["grid_thws"])
    opt = build_vision_optimizer(model, cfg)
    balancer = ExpertBalancer(model, mode="quantile")
    sets = {"in_distribution": eval_items(cfg.seed + 1, cfg.eval_scenes // 2, "train", vcfg),
            "heldout": eval_items(cfg.seed + 2, cfg.eval_scenes, "heldout", vcfg)}
    blind = blind_baselines(cfg.seed + 3)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny VLM: {n_params:,} parameters (vision {sum(p.numel() for p in model.vision_tower.parameters()):,} + "
        f"projector {sum(p.numel() for p in model.mm_projector.parameters()):,}); "
        f"held-out combinations: {', '.join(f'{c} {s}' for c, s in sorted(syn.HELD_OUT))}")
    log(f"chance (best answer without looking at the image): {_fmt(blind)}")
    metrics = open(out / "metrics.jsonl", "w")
    t0, step, stopped_early = time.perf_counter(), 0, False
    model.train()
    while step < cfg.max_steps:
        if cfg.time_budget is not None and time.perf_counter() - t0 > cfg.time_budget:
            stopped_early = True
            break
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        logits, targets, rows = answer_logits(model, train_batch(rng, examples, cfg.batch_size,
                                                                  cfg.questions_per_image), return_rows=True)
        loss = cross_entropy(logits, targets)
        shared = shared_row_fraction(rows.float())
        total = loss + cfg.centring_weight * shared if cfg.centring_weight > 0 else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        balancer.observe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.step()
        step += 1
        rec = {"step": step, "loss": loss.item(), "shared_row_fraction": shared.item(), "lr": lr,
               "time": time.perf_counter() - t0}
        if step % cfg.eval_every == 0 and step < cfg.max_steps:
            rec["eval"] = evaluate(model, examples, sets)
            log(f"step {step}: loss {rec['loss']:.3f} shared {rec['shared_row_fraction']:.2f}  {_fmt(rec['eval'])}  "
                f"({rec['time']:.0f} s)", flush=True)
        elif step % 10 == 0:
            log(f"step {step}: loss {rec['loss']:.3f} shared {rec['shared_row_fraction']:.2f}  ({rec['time']:.0f} s)",
                flush=True)
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
    seconds = time.perf_counter() - t0
    final = evaluate(model, examples, sets)
    metrics.close()
    model.save_pretrained(out / "model", dtype=None)
    tok.save_pretrained(out / "model")  # tokenizer.json + tokenizer_config.json, as k3 train writes
    summary = {"steps": step, "stopped_early": stopped_early, "seconds": seconds, "accuracy": final,
               "chance": blind, "heldout_accuracy": _mean(final["heldout"]),
               "in_distribution_accuracy": _mean(final["in_distribution"]), "model_dir": str(out / "model"),
               "config": asdict(cfg)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"final after {step} steps ({seconds:.0f} s): {_fmt(final)}")
    log(f"chance (blind, best answer per question): {_fmt(blind)}")
    return summary


def _mean(d: dict) -> float:
    return sum(d.values()) / len(d)


def _fmt(ev: dict) -> str:
    return "  ".join(f"{split} " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) for split, kinds in ev.items())
