"""Memory of one single-process training step, estimated before the run allocates anything, so that a huge
--seq-len or --batch-size fails in one line that says what fits instead of in the allocator.

- weights, gradients and optimizer state: counted on a meta-device model (fp32 weights and gradients; Muon keeps
  one fp32 momentum, AdamW two moments, per parameter of their groups);
- activations: the bytes autograd keeps for backward, measured per token on a short probe forward (float32, CPU
  paths, packed-document mask as in training) of the same model with its routed experts cut to the top-k: expert
  weights do not change what a token keeps. One term grows with T²: on the CPU, SDPA keeps each MLA layer's fp32
  attention probabilities [H, T, T] (and the [T, T] document mask), counted from the config. With per-layer
  activation checkpointing a layer keeps only its input, plus one layer's working set during its recomputation.
- the step's peak: backward holds the activations' gradients beside what forward kept, and the allocator keeps
  freed memory, so a step's peak resident memory is PEAK_FACTOR × the kept bytes or more (1.51-1.84× measured on
  `tiny` from 2 × 256 to 1 × 8192 tokens: benchmarks/bench_train_memory.py); the check takes less than the low end,
  so a refused step surely would not fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config
from k3.memory import NotEnoughMemoryError, available_bytes, format_bytes

PROBE_TOKENS = 128
PEAK_FACTOR = 1.4


@dataclass(frozen=True)
class TrainMemory:
    fixed: int  # weights + gradients + optimizer state
    per_token: float  # kept activation bytes per token of one micro-batch, besides...
    per_token_squared: float  # ...these bytes per sequence per T² (CPU attention probabilities)

    def kept(self, batch: int, seq_len: int) -> float:
        return batch * seq_len * (self.per_token + self.per_token_squared * seq_len)

    def total(self, batch: int, seq_len: int) -> int:
        """Estimated peak of one training step, bytes."""
        return int(self.fixed + PEAK_FACTOR * self.kept(batch, seq_len))

    def max_batch(self, seq_len: int, free: int) -> int:
        return max(0, int((free - self.fixed) / (PEAK_FACTOR * self.kept(1, seq_len))))

    def max_seq_len(self, batch: int, free: int) -> int:
        room = (free - self.fixed) / (PEAK_FACTOR * batch)  # per sequence: a·T + q·T² <= room
        a, q = self.per_token, self.per_token_squared
        return max(0, int((-a + (a * a + 4 * q * room) ** 0.5) / (2 * q) if q else room / a))


def state_bytes(config: K3Config, optimizer: str = "muon") -> int:
    """fp32 weights + fp32 gradients + optimizer state, from a meta-device build (nothing allocated)."""
    from k3.model.decoder import K3ForCausalLM
    from k3.train.optim import param_role

    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    total = 0
    for name, p in model.named_parameters():
        muon = optimizer == "muon" and param_role(name, p)[0] == "muon"
        total += p.numel() * (4 + 4 + (4 if muon else 8))
    return total


def attention_bytes_per_position(config: K3Config) -> int:
    """Bytes per sequence per T² kept by CPU attention: fp32 probabilities [H, T, T] + the bool document mask,
    in every MLA layer."""
    return len(config.mla_layer_ids) * (config.num_attention_heads * 4 + 1)


def _saved_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes of the unique storages a training forward saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids, doc_ids=torch.zeros_like(input_ids), labels=input_ids).loss
    del loss  # storages stay alive (so no address is reused) until here
    return sum(seen.values())


def activation_bytes_per_token(config: K3Config, activation_checkpointing: bool = False,
                               tokens: int = PROBE_TOKENS) -> float:
    """Kept bytes per token, besides the T² attention term: measured on a probe forward of `tokens` tokens
    (see the module docstring)."""
    from k3.model.decoder import K3ForCausalLM

    probe_config = config.replace(num_experts=config.num_experts_per_token)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # the same probe each time; the caller's RNG kept
        torch.manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (1, tokens))
        model = K3ForCausalLM(probe_config).float().train()
    full = _saved_bytes(model, ids) / tokens - attention_bytes_per_position(config) * tokens
    if not activation_checkpointing:
        return full
    model.model.gradient_checkpointing = True
    outside = _saved_bytes(model, ids) / tokens  # embedding, output mix, norm, lm_head and loss
    L = config.num_hidden_layers
    return outside + L * config.hidden_size * 4 + (full - outside) / L


def estimate_train_memory(config: K3Config, optimizer: str = "muon",
                          activation_checkpointing: bool = False) -> TrainMemory:
    """The step's memory model; the attention term is one MLA layer's under checkpointing (one layer is live)."""
    quadratic = attention_bytes_per_position(config)
    if activation_checkpointing:
        quadratic //= max(len(config.mla_layer_ids), 1)
    return TrainMemory(state_bytes(config, optimizer), activation_bytes_per_token(config, activation_checkpointing),
                       quadratic)


def check_train_fits(config: K3Config, batch: int, seq_len: int, optimizer: str = "muon",
                     activation_checkpointing: bool = False, device: str = "cpu",
                     activations: bool = True) -> TrainMemory | None:
    """Raises NotEnoughMemoryError, saying what fits, when a training step of batch × seq_len tokens would not
    fit in the memory `device` has free. Returns the estimate (None when the free memory is unknown, or when
    activations=False: only the weights, gradients and optimizer state are checked, as on a GPU, where the
    probe's CPU float32 activations would overstate what bf16 autocast and the GPU kernels keep)."""
    free = available_bytes(device)
    if free is None:
        return None
    fixed = state_bytes(config, optimizer)
    if fixed > free:  # no batch fits: say so without building the probe
        raise NotEnoughMemoryError(f"training this preset needs {format_bytes(fixed)} for weights, gradients and "
                                   f"{optimizer} state alone, but only {format_bytes(free)} is free on {device}")
    if not activations:
        return None
    mem = estimate_train_memory(config, optimizer, activation_checkpointing)
    need = mem.total(batch, seq_len)
    if need <= free:
        return mem
    fits = [f"--batch-size {b} at this --seq-len" if (b := mem.max_batch(seq_len, free)) else None,
            f"--seq-len {t} at this --batch-size" if (t := mem.max_seq_len(batch, free)) else None]
    fits = [f for f in fits if f] or [f"no --seq-len {seq_len}"]
    hint = "" if activation_checkpointing else " (--activation-checkpointing keeps far less)"
    raise NotEnoughMemoryError(
        f"--batch-size {batch} --seq-len {seq_len} needs about {format_bytes(need)} for a training step "
        f"({format_bytes(fixed)} weights, gradients and {optimizer} state + activations) but only "
        f"{format_bytes(free)} is free on {device}; what fits: {' or '.join(fits)}{hint}")
