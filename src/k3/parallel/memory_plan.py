"""`k3 plan`: per-GPU memory of a K3 training or serving layout (dp × cp GPUs, experts over ep of them), whether
it fits, and the smallest GPU count that does. Parameter counts come from k3.info.model_report.

Assumptions (printed with the plan):
- weights: routed experts MXFP4 (4 bits + one E8M0 byte per 32 = 4.25 bits), everything else bf16.
  Experts are split over ep GPUs, plus one layer's worth of MoonEP replicas (≤ E/ep experts) in flight.
- training: dense parameters (weights, gradients, optimizer state) FSDP-sharded over all GPUs; expert
  gradients bf16 and optimizer state split over ep; optimizer state is an fp32 master copy plus Muon's one
  fp32 momentum (8 B/param) or AdamW's two (12 B/param). Activations with per-layer recomputation: every
  layer's bf16 input kept, one layer's working set live, and the fp32 logits of the local tokens.
- serving: dense weights replicated on every GPU (no tensor parallelism here); MLA latent KV in bf16 for
  the GPU's sequences and its 1/cp of the context; one KDA state per sequence per layer (fp32); activations
  of one prefill chunk.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from k3.config import K3Config

MXFP4_BYTES = 4.25 / 8


def parse_bytes(text: str) -> int:
    """'141GB' (10^9), '80GiB' (2^30), '512M', '1.5T' or a plain number of bytes → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"--gpu-memory: expected a size like 141GB, 80GiB or 96G, got {text!r}")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    v = int(value * (1024 if binary else 1000) ** power)
    if v <= 0:
        raise ValueError(f"--gpu-memory must be positive, got {text!r}")
    return v


def bare_number_warning(text: str) -> str | None:
    """A --gpu-memory without a unit is bytes; under 1 GiB that is surely a forgotten unit (141 → 141GB)."""
    t = str(text).strip()
    if re.fullmatch(r"[0-9]*\.?[0-9]+", t) and float(t) < 2**30:
        return f"--gpu-memory {t} means {t} bytes (a number without a unit is bytes); did you mean {t}GB?"
    return None


@dataclass
class MemoryPlan:
    mode: str
    gpus: int
    dp: int
    ep: int
    cp: int
    gpu_memory: int
    parts: dict = field(default_factory=dict)  # name → bytes per GPU

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory


def _counts(config: K3Config) -> dict:
    from k3.info import model_report
    r = model_report(config)
    experts = r["components"]["routed experts"]
    return {"experts": experts, "dense": r["total"] - experts, "report": r}


def _check_dims(config: K3Config, gpus: int, dp, ep, cp) -> tuple[int, int, int]:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1, got {gpus!r}")
    cp = cp or 1
    if gpus % cp:
        raise ValueError(f"--cp {cp} must divide --gpus {gpus}")
    dp = dp or gpus // cp
    if dp * cp != gpus:
        raise ValueError(f"--dp {dp} × --cp {cp} must equal --gpus {gpus}")
    ep = ep or math.gcd(gpus, config.num_experts)
    if gpus % ep or config.num_experts % ep:
        raise ValueError(f"--ep {ep} must divide --gpus {gpus} and the number of experts {config.num_experts}")
    return dp, ep, cp


def plan_memory(config: K3Config, gpus: int, gpu_memory: int, mode: str = "train", dp: int | None = None,
                ep: int | None = None, cp: int | None = None, seq_len: int = 8192, batch: int | None = None,
                optimizer: str = "muon", prefill_chunk: int = 8192, _counts_cache: dict | None = None) -> MemoryPlan:
    """Per-GPU bytes of one layout. seq_len: training sequence / serving context; batch: sequences
    (training: global batch, default one per data-parallel rank; serving: concurrent sequences, default dp)."""
    if mode not in ("train", "serve"):
        raise ValueError(f"--mode must be 'train' or 'serve', got {mode!r}")
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    dp, ep, cp = _check_dims(config, gpus, dp, ep, cp)
    if seq_len < cp:
        raise ValueError(f"--cp {cp} is larger than the sequence length {seq_len}")
    c = _counts_cache or _counts(config)
    E, D, k = config.num_experts, config.hidden_size, config.num_experts_per_token
    n_moe = sum(config.is_moe(l) for l in range(config.num_hidden_layers))
    per_expert = c["experts"] // max(n_moe * E, 1)
    batch = batch or dp
    seqs = math.ceil(batch / dp)  # sequences per GPU
    tokens = seqs * math.ceil(seq_len / cp)  # tokens per GPU
    local_experts = c["experts"] / ep
    replicas = (E // ep) * per_expert  # one layer's worth of fetched replicas
    parts = {"expert weights (MXFP4)": (local_experts + replicas) * MXFP4_BYTES}
    la = config.linear_attn_config
    H, d = la.num_heads, la.head_dim
    working = 2 * (12 * D + 8 * H * d + k * (config.routed_expert_hidden_size + 3 * config.moe_intermediate_size))
    if mode == "train":
        opt = 8 if optimizer == "muon" else 12
        parts["dense weights (bf16, FSDP)"] = c["dense"] * 2 / gpus
        parts["gradients (bf16)"] = c["dense"] * 2 / gpus + local_experts * 2
        parts[f"optimizer state ({optimizer}, fp32)"] = (c["dense"] / gpus + local_experts) * opt
        # every layer's input kept for recomputation (AttnRes block sums are among them), one layer live,
        # KDA chunk states of the live layer, fp32 logits of the local tokens
        kda_states = seqs * math.ceil(seq_len / cp / 64) * H * d * d * 4
        parts["activations"] = (tokens * (config.num_hidden_layers * D * 2 + working)
                                + kda_states + tokens * config.vocab_size * 4)
    else:
        r = c["report"]
        parts["dense weights (bf16, replicated)"] = c["dense"] * 2
        parts["MLA latent KV (bf16)"] = r["mla_cache_bytes_per_token_bf16"] * tokens
        parts["KDA states (fp32)"] = r["kda_state_bytes_per_sequence"] * seqs
        chunk = min(prefill_chunk, tokens)
        parts["activations"] = chunk * (working + config.vocab_size * 4 / max(seqs, 1))
    return MemoryPlan(mode, gpus, dp, ep, cp, gpu_memory, {k: int(v) for k, v in parts.items()})


def smallest_fit(config: K3Config, gpu_memory: int, mode: str = "train", cp: int | None = None,
                 max_gpus: int = 8192, **kwargs) -> MemoryPlan | None:
    """The fewest GPUs (dp = gpus / cp, ep = gcd(gpus, experts)) whose plan fits, or None up to max_gpus."""
    counts = _counts(config)
    cp = cp or 1
    for gpus in range(cp, max_gpus + 1, cp):
        p = plan_memory(config, gpus, gpu_memory, mode=mode, cp=cp, _counts_cache=counts, **kwargs)
        if p.fits:
            return p
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def format_plan(p: MemoryPlan, smallest: MemoryPlan | None) -> str:
    lines = [f"{p.mode} on {p.gpus} GPU(s) of {_gb(p.gpu_memory)}: dp {p.dp} × cp {p.cp}, experts over ep {p.ep}"]
    for name, v in p.parts.items():
        lines.append(f"  {name:<34}{_gb(v):>14}")
    lines.append(f"  {'total per GPU':<34}{_gb(p.total):>14}   {'fits' if p.fits else 'does NOT fit'}")
    if smallest is None:
        lines.append("  no GPU count up to the search limit fits")
    else:
        lines.append(f"  smallest layout that fits: {smallest.gpus} GPUs (dp {smallest.dp} × cp {smallest.cp}, "
                     f"ep {smallest.ep}), {_gb(smallest.total)} per GPU")
    return "\n".join(lines)
