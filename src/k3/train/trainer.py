"""k3's main job: train a K3 on the bundled corpus with Muon, Quantile Balancing and exact resume."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from k3 import envs
from k3.balance import ExpertBalancer
from k3.config import ConfigError, K3Config
from k3.cpu_threads import ThreadGovernor
from k3.data import PackedLoader, Tokenizer, eval_batches, load_corpus, load_token_docs, split_documents
from k3.data.stats import unigram_cross_entropy
from k3.memory import NotEnoughMemoryError, format_bytes
from k3.model.decoder import K3ForCausalLM
from k3.checkpoint.hf import CheckpointError
from k3.train.optim import build_optimizer
from k3.train.run_dir import (RunDirError, check_resume_config, check_run_dir, claim_run_dir, clear_previous_run,
                              complete_checkpoints, default_run_dir, load_state_file, read_trainer_state,
                              remove_stale_temporaries, saved_train_config)
from k3.train.schedule import apply_lr, wsd_multiplier


@dataclass
class TrainConfig:
    preset: str = "tiny"
    out: str | None = None  # None: runs/<preset>
    corpus: str | None = None  # None: the bundled Shakespeare
    data: str | None = None  # OpenAI-format conversations (JSONL): trains on them instead of the corpus
    tokenizer: str | None = None  # None: the bundled BPE
    max_steps: int = 300
    time_budget: float | None = None  # seconds; training stops early (and still evaluates and saves)
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 0.01
    optimizer: str = "muon"
    weight_decay: float = 0.1
    warmup_steps: int = 20
    decay_fraction: float = 0.3
    grad_clip: float = 1.0
    balance: str = "quantile"
    eval_every: int = 50
    eval_batches: int = 6
    final_eval_batches: int | None = None  # None: the whole validation split
    save_every: int = 100
    seed: int = 0
    sample_prompt: str = "KING HENRY:"
    sample_tokens: int = 48
    device: str = "auto"
    resume: bool = False  # continue the run in `out` from its newest good checkpoint
    overwrite: bool = False  # a fresh run may replace the previous run in `out` (never other files)
    dp: int = 1  # k3.parallel: data × context parallel ranks (torchrun), experts sharded over ep of them
    ep: int = 1
    cp: int = 1
    fsdp: bool = False  # FSDP2: shard the non-expert parameters (and their optimizer state) over all ranks
    qat: bool = False  # MXFP4 expert weights / MXFP8 expert activations fake-quantized (k3.ops.mx_experts)
    activation_checkpointing: bool = False  # keep each decoder layer's inputs only; recompute it in backward
    compile: bool = False  # KDA, MLA, MoE, dense MLP training forwards through torch.compile (k3.train.compiled_regions)

    def __post_init__(self):
        if self.out is None:
            self.out = default_run_dir(self.preset)

    def validate(self) -> None:
        def need(cond, name, allowed):
            if not cond:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}: {allowed}")
        for name in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "save_every"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        need(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a positive number")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(0 <= self.decay_fraction <= 1, "decay_fraction", "must lie in [0, 1]")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(self.time_budget is None or self.time_budget > 0, "time_budget", "must be > 0 seconds")
        need(self.optimizer in ("muon", "adamw"), "optimizer", "one of muon, adamw")
        need(self.balance in ("quantile", "sign", "none"), "balance", "one of quantile, sign, none")
        need(self.sample_tokens >= 0, "sample_tokens", "must be >= 0")
        need(not self.fsdp or self.dp * self.cp > 1, "fsdp", "needs more than one process (--nproc N, N > 1)")
        need(not self.compile or self.ep == 1, "compile", "does not combine with --ep > 1 (expert parallelism "
             "exchanges tokens between processes inside the MoE layer); leave one of them off")
        need(self.batch_size % self.dp == 0, "batch_size", f"must be divisible by --dp {self.dp} (rows split over ranks)")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available():  # as many GPUs as both runs see (the count may differ)
        for i, state in enumerate(s["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)


class Trainer:
    """Owns the data, model, optimizer, balancer and checkpoints of one run directory."""

    def __init__(self, cfg: TrainConfig, log=print, warn=None):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))
        self.out = Path(cfg.out)
        # before any rank can write (they all meet in init_distributed below), and before the data is loaded
        check_run_dir(self.out, resume=cfg.resume, overwrite=cfg.overwrite)
        if cfg.resume:
            check_resume_config(asdict(cfg), saved_train_config(self.out, warn=lambda m: None), self.out)
        self.device = pick_device(cfg.device)
        # CPU threads sized to the cores other processes leave free, re-chosen each step (k3.cpu_threads)
        self.cpu_threads = ThreadGovernor() if self.device.type == "cpu" else None
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        self.tokenizer = tok = Tokenizer.from_file(cfg.tokenizer)
        self.sample_ids = None  # a conversation run's sample prompt (ids); text runs encode cfg.sample_prompt
        if cfg.data:  # conversations in the chat markup, the loss on the assistant's tokens only
            from k3.data.conversations import (ConversationLoader, conversation_eval_batches, load_conversations,
                                               render_conversations)
            convs = render_conversations(tok, load_conversations(cfg.data))
            order = np.random.default_rng(cfg.seed).permutation(len(convs))
            n_val = min(len(convs) // 20, 200) or (1 if len(convs) > 1 else 0)  # 5% (at most 200) held out
            val = [convs[i] for i in order[:n_val]] or convs
            train = [convs[i] for i in order[n_val:]]
            self.train_ids, self.val_ids = [c[0] for c in train], [c[0] for c in val]
            self.loader = ConversationLoader(train, cfg.seq_len, cfg.batch_size, cfg.seed)
            self.val_batches = conversation_eval_batches(val, cfg.seq_len, cfg.batch_size, tok.pad_id)
            # samples continue a held-out conversation where its assistant's first learned token begins
            ids, learned = val[0]
            self.sample_ids = ids[:learned.index(True)] if True in learned else ids
        else:
            train_docs, val_docs = split_documents(load_corpus(cfg.corpus), seed=cfg.seed)
            self.train_ids = load_token_docs(tok, train_docs)
            self.val_ids = load_token_docs(tok, val_docs)
            self.loader = PackedLoader(self.train_ids, cfg.seq_len, cfg.batch_size, cfg.seed, tok.bos_id, tok.eos_id,
                                       tok.pad_id)
            self.val_batches = eval_batches(self.val_ids, cfg.seq_len, cfg.batch_size, tok.bos_id, tok.eos_id,
                                            tok.pad_id)

        if cfg.dp * cfg.cp > 1 or cfg.ep > 1:
            # join the process group before placing the model: on GPUs it makes this rank's device
            # (LOCAL_RANK) current, and "cuda" without an index would put every rank's model on GPU 0
            from k3.parallel.mesh import init_distributed
            init_distributed(device_type=self.device.type)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = K3Config.preset(cfg.preset).replace(
            vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        self.model = K3ForCausalLM(self.model_config).to(self.device)
        self.model.reset_parameters(seed=cfg.seed)
        self.model.model.gradient_checkpointing = cfg.activation_checkpointing
        if self.cpu_threads is not None:  # re-chosen between layers too: a step need not end before it adapts
            for layer in self.model.model.layers:  # (the decoder calls a layer's parts, not the layer)
                layer.self_attn.register_forward_pre_hook(self._poll_threads)
        if cfg.qat:
            from k3.ops.mx_experts import enable_qat
            enable_qat(self.model)
        self.dist = None  # k3.parallel.training.DistributedTraining when running on several processes
        if cfg.dp * cfg.cp > 1 or cfg.ep > 1:
            from k3.parallel.training import DistributedTraining
            self.dist = DistributedTraining(self.model, cfg.dp, cfg.ep, cfg.cp, cfg.seq_len, fsdp=cfg.fsdp)
            if not self.dist.is_main:
                self.log = self.warn = lambda *a, **k: None
        if cfg.compile:  # after FSDP2 wraps the modules: the compiled forwards run between its hooks
            from k3.train.compiled_regions import compile_regions
            compile_regions(self.model)
            if self.device.type == "cpu":
                self.warn("--compile targets CUDA: on the CPU the compiled MoE layers gather each row's expert "
                          "weights (fp32 grouped GEMMs cannot be traced), and a tiny step ran 2.4x slower than eager")
        self.optimizer = build_optimizer(self.model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if self.dist:  # each replicated Muon matrix orthogonalised by one rank, not by all
            self.dist.spread_muon(self.optimizer)
        self.balancer = ExpertBalancer(self.model, mode=cfg.balance,
                                       all_reduce=self.dist.all_reduce_counts if self.dist else None)
        self.step = 0
        self.history: list[dict] = []
        # set once a step ran out of memory with fla's intermediates kept: every step from it recomputes them
        self.recompute_fla = False
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None

    # ---- checkpoints --------------------------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Writes checkpoints/step_N atomically: a temporary directory renamed into place, then `latest`.
        A save that fails (a full disk) or is interrupted (Ctrl-C) removes its temporary directory and leaves
        the previous checkpoint as it was; a failure to write is a RunDirError saying so."""
        final = self.ckpt_root / f"step_{self.step:06d}"
        tmp = self.ckpt_root / f".tmp-step_{self.step:06d}-{'dist' if self.dist else os.getpid()}"
        try:
            return self._save_checkpoint(final, tmp)
        except BaseException as e:
            if not self.dist or self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, (OSError, RuntimeError, SafetensorError)):  # torch's own writer raises RuntimeError
                raise RunDirError(self._save_failure(final, e)) from None
            raise

    def _save_failure(self, final: Path, e: BaseException) -> str:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        try:
            free = f"{shutil.disk_usage(self.ckpt_root).free / 2**20:.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        done = complete_checkpoints(self.ckpt_root) if self.ckpt_root.is_dir() else []
        kept = f"the previous checkpoint {done[0]} is intact" if done else "no earlier checkpoint exists"
        return f"saving checkpoint {final} failed: {reason} ({free}); its partial files were removed and {kept}"

    def _save_checkpoint(self, final: Path, tmp: Path) -> Path:
        model = self.model
        if self.dist:  # every rank: gather the full model, write its own optimizer state; rank 0 the rest
            model = self.dist.full_model()  # tmp: one name on every rank
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.dist.barrier()
            torch.save({"optimizer": self.dist.optimizer_state(self.optimizer), "rng": rng_state(),
                        "layout": self.dist.layout}, tmp / f"rank_{self.dist.rank:05d}.pt")
            self.dist.barrier()  # trainer_state.pt (which marks the checkpoint complete) comes after all ranks'
            if not self.dist.is_main:
                self.dist.barrier()
                return final
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        if not self.dist:
            shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, dtype=None)  # float32 master weights: resume must be exact
        self.tokenizer.save_pretrained(tmp)  # tokenizer.json + tokenizer_config.json (transformers, llama.cpp)
        torch.save({
            "step": self.step, "optimizer": None if self.dist else self.optimizer.state_dict(),
            "loader": self.loader.state_dict(), "rng": rng_state(), "history": self.history,
            "train_config": asdict(self.cfg), "layout": self.dist.layout if self.dist else None,
        }, tmp / "trainer_state.pt")
        _fsync_dir_files(tmp)
        old = None
        if final.exists():  # a resume that fell back past a damaged checkpoint saves its step again
            old = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old)
        _atomic_write(self.ckpt_root / "latest", final.name + "\n")
        if self.dist:
            self.dist.barrier()
        return final

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint; temporary directories of interrupted saves are never considered."""
        done = complete_checkpoints(self.ckpt_root)
        return done[0] if done else None

    def resume(self) -> Path:
        """Loads the newest checkpoint that reads back whole; a damaged newer one is skipped with a warning."""
        problems = []
        for ckpt in complete_checkpoints(self.ckpt_root):
            try:
                self.load_checkpoint(ckpt)
                return ckpt
            except (CheckpointError, ConfigError) as e:
                problems.append(str(e).splitlines()[0])
                self.warn(f"checkpoint {ckpt.name} is damaged ({problems[-1]}); trying the one before it")
        raise RunDirError(f"--resume: no complete checkpoint under {self.ckpt_root}"
                          + (f" reads back ({'; '.join(problems)})" if problems else ""))

    def load_checkpoint(self, path: Path) -> None:
        """Restores the model, optimizer, data position, RNG and history of checkpoint `path`. A damaged file
        raises a CheckpointError naming it before anything is changed."""
        from k3.checkpoint.hf import load_pretrained

        state = read_trainer_state(path)  # on the CPU: a GPU run resumes on a CPU-only host too
        saved, now = state.get("layout"), self.dist.layout if self.dist else None
        if saved != now:
            raise ValueError(f"--resume: {path} was written by a run with layout {saved or 'single process'}; "
                             f"resume it with the same --nproc/--dp/--ep/--cp/--fsdp (this run: {now or 'single process'})")
        loaded = load_pretrained(path, device="cpu")  # host memory: beside the training model, a second GPU copy
        if self.dist:  # the full model into this rank's shards; this rank's own optimizer state and RNG
            mine = load_state_file(path / f"rank_{self.dist.rank:05d}.pt")
            self.dist.load_full_state_dict(loaded.state_dict())
            self.dist.load_optimizer_state(self.optimizer, mine["optimizer"])
            set_rng_state(mine["rng"])
        else:
            self.model.load_state_dict(loaded.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
        self.loader.load_state_dict(state["loader"])
        self.step, self.history = state["step"], state["history"]

    # ---- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None, progress: str | None = None) -> float:
        """Mean validation cross-entropy (nats/token) over the first max_batches batches (all when None).
        progress: show a bar with this label (the final pass over the whole validation set takes minutes)."""
        self.model.eval()
        total, count = 0.0, 0
        batches = self.val_batches[:max_batches]
        if progress and not (self.dist and not self.dist.is_main):
            from tqdm import tqdm
            batches = tqdm(batches, desc=progress, leave=False, dynamic_ncols=True, mininterval=0)  # every batch drawn
        for b in batches:
            b = {k: v.to(self.device) for k, v in b.items()}
            if self.dist:
                with self.autocast or _null():
                    s, n = self.dist.eval_sums(b)
                total, count = total + s, count + n
                continue
            with self.autocast or _null():
                logits = self.model(b["input_ids"], doc_ids=b["doc_ids"]).logits
            n = int((b["labels"] != -100).sum())
            if n:
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(),
                                                         ignore_index=-100, reduction="sum")
                total, count = total + float(loss), count + n
        self.model.train()
        return total / max(count, 1)

    def sample(self, max_new_tokens: int | None = None, seed: int = 0) -> str:
        if self.dist and self.cfg.cp > 1:
            return "(no sample: decoding does not run under context parallelism)"
        chat = self.sample_ids is not None
        ids = self.sample_ids if chat else self.tokenizer.encode(self.cfg.sample_prompt, add_bos=True)
        # no CUDA graph under several processes: the expert-parallel step's collectives cannot be captured
        out = self.model.generate(ids, max_new_tokens=max_new_tokens or self.cfg.sample_tokens, temperature=0.8,
                                  top_k=50, seed=seed, eos_token_id=self.tokenizer.eos_id,
                                  cuda_graph=False if self.dist else None)
        if chat:  # the assistant's turn alone, its markup kept: the format is what a chat run learns
            return self.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=False)
        return self.tokenizer.decode(out[0].tolist(), skip_special_tokens=True)

    def unigram_baseline(self) -> float:
        eos = [self.tokenizer.eos_id]
        flat = lambda docs: [t for d in docs for t in list(d) + eos]
        return unigram_cross_entropy(flat(self.train_ids), flat(self.val_ids), self.tokenizer.vocab_size)

    # ---- training -----------------------------------------------------------------------------------
    def _poll_threads(self, module, args) -> None:  # a forward pre-hook: returns None, so the inputs stand
        self.cpu_threads.poll()

    def train_step(self) -> dict:
        cfg = self.cfg
        if self.cpu_threads:
            self.cpu_threads.update()
        t0 = time.perf_counter()
        lr_mult = wsd_multiplier(self.step, cfg.max_steps, cfg.warmup_steps, cfg.decay_fraction)
        apply_lr(self.optimizer, lr_mult)
        batches = [self.loader.next_batch() for _ in range(cfg.grad_accum)]
        try:
            loss_sum, tokens = self._forward_backward(batches)
            again = False
        except torch.OutOfMemoryError as e:
            if not self._may_recompute_fla():
                raise self._out_of_memory() from e
            again = True  # (run again outside this block: the exception's frames hold the step's tensors)
        if again:
            self._recompute_fla_from_now()
            try:
                loss_sum, tokens = self._forward_backward(batches)
            except torch.OutOfMemoryError as e:
                raise self._out_of_memory() from e
        if self.dist:
            self.dist.sync_gradients()
            grad_norm = self.dist.clip_grad_norm_(cfg.grad_clip)
            loss_sum = self.dist.global_sum(loss_sum)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        bal = self.balancer.step()  # the new bias is first used by the next step's batches
        self.step += 1
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": loss_sum / cfg.grad_accum, "lr": self.optimizer.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens_per_s": tokens / dt, "maxvio": bal["maxvio_mean"],
               "maxvio_layers": bal["maxvio"], "load": bal["load"], "epoch": self.loader.epoch}
        return rec

    def _forward_backward(self, batches: list[dict]) -> tuple[float, int]:
        """The step's micro-batches forward and backward, gradients summed into .grad: (loss sum, tokens)."""
        loss_sum, tokens = 0.0, 0
        with envs.override(fla_keep_forward=False) if self.recompute_fla else _null():
            for batch in batches:
                b = {k: v.to(self.device) for k, v in batch.items()}
                with self.autocast or _null():
                    loss = (self.dist or self.model)(b["input_ids"], doc_ids=b["doc_ids"], labels=b["labels"]).loss
                (loss / self.cfg.grad_accum).backward()  # the logits are not held here: backward frees them early
                self.balancer.observe()
                loss_sum += float(loss.detach())
                tokens += b["input_ids"].numel()
        return loss_sum, tokens

    def _may_recompute_fla(self) -> bool:
        """Whether a step out of memory may run again with KDA's backward recomputing fla's forward intermediates
        (K3_FLA_KEEP_FORWARD's memory, 10 GiB for `small` at 8 x 4096): they were kept, and one process trains
        (ranks that ran out and ranks that did not would part)."""
        return envs.current().fla_keep_forward and not self.recompute_fla and not self.dist

    def _recompute_fla_from_now(self) -> None:
        """The step's partial gradients, balancer counts and cached blocks dropped; this and every later step
        recompute fla's intermediates (nothing of the step was applied: it runs again on the same batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.discard()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.recompute_fla = True
        self.log(f"step {self.step + 1} ran out of {self.device}'s memory with fla's forward intermediates kept for "
                 f"KDA's backward; it runs again, and every later step, recomputing them (K3_FLA_KEEP_FORWARD=0)")

    def _out_of_memory(self) -> NotEnoughMemoryError:
        """A training step that ran out of GPU memory, as one line saying how to fit it (the last checkpoint stands)."""
        cfg, dev = self.cfg, self.device
        used = ""
        if dev.type == "cuda":
            used = (f" ({format_bytes(torch.cuda.max_memory_allocated(dev))} allocated at the peak, of "
                    f"{format_bytes(torch.cuda.get_device_properties(dev).total_memory)})")
        fixes = ["a smaller --batch-size (--grad-accum keeps the tokens a step)"]
        if not cfg.activation_checkpointing:
            fixes.append("--activation-checkpointing")
        if envs.current().fla_keep_forward and not self.recompute_fla:
            fixes.append("K3_FLA_KEEP_FORWARD=0 (KDA's backward recomputes fla's forward intermediates rather than "
                         "keeping them: 10 GiB less for `small` at 8 x 4096 on an H200)")
        return NotEnoughMemoryError(f"the training step ({cfg.batch_size} x {cfg.seq_len} tokens a micro-batch) ran "
                                    f"out of {dev}'s memory{used}; to fit it: {', or '.join(fixes)}")

    def run(self) -> dict:
        """Train to max_steps (or the time budget), evaluate, export the model; the summary."""
        main_rank = not self.dist or self.dist.is_main
        # rank 0 holds the run directory while the run writes: a second `k3 train` on it is refused
        with claim_run_dir(self.out) if main_rank else contextlib.nullcontext():
            return self._run()

    def _run(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        main_rank = not self.dist or self.dist.is_main  # rank 0 owns the run directory (another rank would race it)
        if cfg.resume:
            if main_rank:
                remove_stale_temporaries(self.out, self.log)
            ckpt = self.resume()
            self.log(f"resumed from {ckpt} at step {self.step}")
            if main_rank:
                _truncate_metrics(self.out / "metrics.jsonl", self.step)
        elif main_rank and cfg.overwrite:
            clear_previous_run(self.out)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.log(f"k3 train: preset {cfg.preset} ({n_params / 1e6:.2f}M parameters), {self.device}, "
                 f"optimizer {cfg.optimizer}, balance {cfg.balance}, batch {cfg.batch_size}x{cfg.seq_len}"
                 f"x{cfg.grad_accum}, {cfg.max_steps} steps{', QAT (MXFP4/MXFP8 experts)' if cfg.qat else ''}"
                 f"{', activation checkpointing' if cfg.activation_checkpointing else ''}"
                 f"{', compiled KDA/MLA/MoE/MLP regions' if cfg.compile else ''}, out {self.out}")
        metrics_f = open(self.out / "metrics.jsonl" if not self.dist or self.dist.is_main else os.devnull, "a")
        start = time.perf_counter()
        stopped_early = False
        quiet = bool(self.dist and not self.dist.is_main)  # other ranks print nothing (rank 0 speaks for all)
        bar = tqdm(total=cfg.max_steps, initial=self.step, dynamic_ncols=True, desc="train", disable=quiet)
        write = (lambda line: None) if quiet else bar.write  # tqdm.write prints even when the bar is disabled
        rec = None  # the last step's record (none when resuming a finished run)
        try:
            while self.step < cfg.max_steps:
                rec = self.train_step()
                if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                    rec["val_loss"] = self.evaluate(cfg.eval_batches)
                    rec["val_ppl"] = math.exp(rec["val_loss"])
                    rec["sample"] = self.sample()
                    write(f"step {self.step}: val loss {rec['val_loss']:.3f} (ppl {rec['val_ppl']:.1f}) | "
                          f"{rec['sample']!r}")
                self.history.append({k: v for k, v in rec.items() if k not in ("load", "maxvio_layers")})
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                lr=f"{rec['lr']:.2e}", maxvio=f"{rec['maxvio']:.2f}")
                bar.update(1)
                if self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save_checkpoint()
                if cfg.time_budget is not None and self._out_of_time(start):
                    stopped_early = True
                    write(f"time budget of {cfg.time_budget:.0f} s reached at step {self.step}")
                    break
        finally:
            bar.close()
            metrics_f.close()
        final = self.save_checkpoint()
        return self.finish(final, stopped_early, last=rec)

    def _out_of_time(self, start: float) -> bool:
        over = time.perf_counter() - start > self.cfg.time_budget
        return self.dist.any(over) if self.dist else over  # all ranks stop together (collectives would hang)

    def finish(self, ckpt: Path, stopped_early: bool, last: dict | None) -> dict:
        """Full validation pass, baseline, plots, the exported model and summary.json."""
        from k3.train.plots import plot_run

        val = self.evaluate(self.cfg.final_eval_batches, progress="final evaluation")
        if self.dist:
            sample = self.sample(64)  # a collective under expert parallelism: every rank decodes
            if not self.dist.is_main:
                return {"val_loss": val, "rank": torch.distributed.get_rank()}
        base = self.unigram_baseline()
        model_dir = self.out / "model"
        tmp = self.out / ".tmp-model"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(ckpt, tmp, ignore=shutil.ignore_patterns("trainer_state.pt", "rank_*.pt"))
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise RunDirError(f"exporting {model_dir} failed: {e.strerror or e}; its partial copy was removed "
                                  f"and checkpoint {ckpt} is intact") from None
            raise
        shutil.rmtree(model_dir, ignore_errors=True)
        os.replace(tmp, model_dir)
        summary = {
            "steps": self.step, "stopped_early": stopped_early, "val_loss": val, "val_ppl": math.exp(val),
            "unigram_baseline": base, "gain_over_unigram": base - val,
            "maxvio_mean_last": last["maxvio"] if last else None,
            "maxvio_layers_last": last["maxvio_layers"] if last else None,
            "balance": self.cfg.balance, "model_dir": str(model_dir), "checkpoint": str(ckpt),
            "sample": sample if self.dist else self.sample(64),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_run(self.out / "metrics.jsonl", self.out)
        return summary


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume from `step`, drop the records of steps the interrupted run logged past its checkpoint, and
    the line it was killed while writing, if any (always past the checkpoint: a step's record precedes its save)."""
    if path.is_file():
        keep = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                keep.append(line)
        _atomic_write(path, "".join(l + "\n" for l in keep))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir_files(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def train_config_from_dict(d: dict) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in d.items() if k in known})
