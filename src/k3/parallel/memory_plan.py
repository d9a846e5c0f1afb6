"""`k3 plan`: per-GPU memory of a K3 training or serving layout (dp × cp GPUs, experts over ep of them), whether
it fits, and the smallest GPU count that does. Parameter counts come from k3.info.model_report.

Assumptions (printed with the plan):
- weights: routed experts MXFP4 (4 bits + one E8M0 byte per 32 = 4.25 bits), everything else bf16.
  Experts are split over ep GPUs, plus one layer's worth of MoonEP replicas (≤ E/ep experts) in flight.
- training: dense parameters (weights, gradients, optimizer state) FSDP-sharded over all GPUs; expert
  gradients bf16 and optimizer state split over ep; optimizer state is an fp32 master copy plus Muon's one
  fp32 momentum (8 B/param) or AdamW's two (12 B/param). Activations with per-layer recomputation: every
  layer's bf16 input kept, one layer's working set live, and the fp32 logits of the local tokens.
- serving (`plan_memory(mode="serve")`, a fixed batch): dense weights replicated on every GPU; MLA latent KV
  in bf16 for the GPU's sequences and its 1/cp of the context; one KDA state per sequence per layer (fp32);
  activations of one prefill chunk.
- `k3 plan --serve` (`plan_serve`, `smallest_serve`): the dense weights split over tp GPUs as rank-sharded
  loading splits them (k3.checkpoint.sharded.tp_slice: attention by heads, MLPs by width, vocabulary), or
  attention kept whole per GPU under data-parallel attention; experts over ep; what is left after weights,
  activations and a runtime reserve holds MLA latents (replicated within a TP group) and KDA states (split by
  heads under TP), sized by the serving pool's own arithmetic (k3.serve.block_pool.plan_capacity).
"""
from __future__ import annotations

import json
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


def config_key(config: K3Config) -> str:
    """A frozen copy of config (its JSON) to key caches by: a config changed in place gets a new key."""
    return json.dumps(config.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class ParamCounts:
    experts: int  # routed experts' parameters, all layers
    dense: int  # every other parameter


_COUNTS: dict[str, ParamCounts] = {}  # config_key → _counts (model_report builds the model on meta: ~1 s at K3 size)


def _counts(config: K3Config) -> ParamCounts:
    key = config_key(config)
    if key not in _COUNTS:
        from k3.info import model_report
        r = model_report(config)
        experts = r["components"]["routed experts"]
        _COUNTS[key] = ParamCounts(experts=experts, dense=r["total"] - experts)
    return _COUNTS[key]


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
                optimizer: str = "muon", prefill_chunk: int = 8192) -> MemoryPlan:
    """Per-GPU bytes of one layout. seq_len: training sequence / serving context; batch: sequences
    (training: global batch, default one per data-parallel rank; serving: concurrent sequences, default dp)."""
    if mode not in ("train", "serve"):
        raise ValueError(f"--mode must be 'train' or 'serve', got {mode!r}")
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    dp, ep, cp = _check_dims(config, gpus, dp, ep, cp)
    if seq_len < cp:
        raise ValueError(f"--cp {cp} is larger than the sequence length {seq_len}")
    c = _counts(config)
    E, D, k = config.num_experts, config.hidden_size, config.num_experts_per_token
    n_moe = sum(config.is_moe(l) for l in range(config.num_hidden_layers))
    per_expert = c.experts // max(n_moe * E, 1)
    batch = batch or dp
    seqs = math.ceil(batch / dp)  # sequences per GPU
    tokens = seqs * math.ceil(seq_len / cp)  # tokens per GPU
    local_experts = c.experts / ep
    replicas = (E // ep) * per_expert  # one layer's worth of fetched replicas
    parts = {"expert weights (MXFP4)": (local_experts + replicas) * MXFP4_BYTES}
    la = config.linear_attn_config
    H, d = la.num_heads, la.head_dim
    working = 2 * (12 * D + 8 * H * d + k * (config.routed_expert_hidden_size + 3 * config.moe_intermediate_size))
    if mode == "train":
        opt = 8 if optimizer == "muon" else 12
        parts["dense weights (bf16, FSDP)"] = c.dense * 2 / gpus
        parts["gradients (bf16)"] = c.dense * 2 / gpus + local_experts * 2
        parts[f"optimizer state ({optimizer}, fp32)"] = (c.dense / gpus + local_experts) * opt
        # every layer's input kept for recomputation (AttnRes block sums are among them), one layer live,
        # KDA chunk states of the live layer, fp32 logits of the local tokens
        kda_states = seqs * math.ceil(seq_len / cp / 64) * H * d * d * 4
        parts["activations"] = (tokens * (config.num_hidden_layers * D * 2 + working)
                                + kda_states + tokens * config.vocab_size * 4)
    else:
        per_token, per_seq = cache_bytes_per_token_and_sequence(config)
        parts["dense weights (bf16, replicated)"] = c.dense * 2
        parts["MLA latent KV (bf16)"] = per_token * tokens
        parts["KDA states (fp32)"] = per_seq * seqs
        chunk = min(prefill_chunk, tokens)
        parts["activations"] = chunk * (working + config.vocab_size * 4 / max(seqs, 1))
    return MemoryPlan(mode, gpus, dp, ep, cp, gpu_memory, {k: int(v) for k, v in parts.items()})


def smallest_fit(config: K3Config, gpu_memory: int, mode: str = "train", cp: int | None = None,
                 max_gpus: int = 8192, **kwargs) -> MemoryPlan | None:
    """The fewest GPUs (dp = gpus / cp, ep = gcd(gpus, experts)) whose plan fits, or None up to max_gpus."""
    cp = cp or 1
    for gpus in range(cp, max_gpus + 1, cp):
        p = plan_memory(config, gpus, gpu_memory, mode=mode, cp=cp, **kwargs)
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


# ---- serving: `k3 plan --serve` ----------------------------------------------------------------------------------
# Marketed memory per card (10^9 B): H200 141 GB, B200-class 192 GB.
GPU_MEMORY = {"h200": 141 * 10**9, "b200": 192 * 10**9}
SERVE_LAYOUTS = ("tp", "dp-attention")
RUNTIME_RESERVE = 4 * 10**9  # per GPU: CUDA context, NCCL buffers, captured graphs
DECODE_ROWS = 256  # fp32 logits of this many decode rows are budgeted as activations


@dataclass
class ServePlan:
    """One serving layout of `gpus` GPUs: experts over `ep` of them (MXFP4, packed), the dense weights split over
    `tp` (attention too under layout "tp"; under "dp-attention" every GPU keeps all of attention and its own
    sequences). Bytes are per GPU unless named otherwise; capacity is for the whole deployment at `context`."""
    gpus: int
    ep: int
    tp: int
    layout: str
    gpu_memory: int
    context: int
    weight_bytes: int  # the whole model (MXFP4 experts packed)
    parts: dict = field(default_factory=dict)
    token_bytes: int = 0  # per GPU, per token of a sequence (MLA latents; replicated within a TP group)
    sequence_bytes: int = 0  # per GPU, per sequence (KDA states; split by heads under TP)
    sequences: int = 0

    @property
    def cache_bytes(self) -> int:
        return self.gpu_memory - sum(self.parts.values())

    @property
    def tokens(self) -> int:
        return self.sequences * self.context

    @property
    def fits(self) -> bool:
        return self.sequences >= 1


_SERVE_TENSORS: dict[str, list] = {}  # config_key → _serve_tensors (a meta build of the released model takes ~1 s)


def _serve_tensors(config: K3Config) -> list[tuple[str, tuple, int, tuple | None]]:
    """(k3 name, shape, bytes as served, TP split (dim, by heads) or None) of every tensor: MXFP4 routed experts,
    the F32 ones in F32, bf16 else."""
    key = config_key(config)
    if key not in _SERVE_TENSORS:
        _SERVE_TENSORS[key] = _build_serve_tensors(config)
    return _SERVE_TENSORS[key]


def _build_serve_tensors(config: K3Config) -> list:
    import torch

    from k3.checkpoint.names import is_f32
    from k3.checkpoint.sharded import tp_split_dim
    from k3.model.decoder import K3ForCausalLM

    with torch.device("meta"):
        state = K3ForCausalLM(config, init=False).state_dict()
    out = []
    for name, t in state.items():
        n = t.numel()
        nbytes = n // 2 + n // 32 if ".experts.w" in name else n * (4 if is_f32(name) else 2)
        out.append((name, tuple(t.shape), nbytes, None if ".experts.w" in name else tp_split_dim(name)))
    return out


def cache_bytes_per_token_and_sequence(config: K3Config, tp: int = 1) -> tuple[int, int]:
    """(bf16 MLA latent bytes per token, KDA state bytes per sequence) on one rank of a tp-wide tensor-parallel
    group (its H/tp KDA heads): the serving pool's own arithmetic."""
    import torch

    from k3.serve.block_pool import plan_capacity
    cap = plan_capacity(config, 0, 1, 0, torch.bfloat16, num_blocks=1, tp=tp)
    return cap.bytes_per_token, cap.bytes_per_slot


def plan_serve(config: K3Config, gpus: int, gpu_memory: int, context: int = 131072, tp: int | None = None,
               layout: str = "tp", ep: int | None = None, prefill_chunk: int = 8192,
               _tensors: list | None = None) -> ServePlan:
    """Per-GPU memory and cache capacity of serving `config` on `gpus` GPUs (see ServePlan).
    tp: default the largest of 8, 4, 2, 1 dividing gpus that the heads and widths allow; ep: default gcd(gpus, experts)."""
    if layout not in SERVE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(SERVE_LAYOUTS)}, got {layout!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1, got {gpus!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"--context must be a positive integer, got {context!r}")
    tensors = _tensors or _serve_tensors(config)
    tp = tp or next(t for t in (8, 4, 2, 1) if gpus % t == 0 and _tp_ok(config, tensors, t))
    if gpus % tp:
        raise ValueError(f"--tp {tp} must divide --gpus {gpus}")
    if not _tp_ok(config, tensors, tp):
        raise ValueError(f"--tp {tp} must divide the attention heads ({config.num_attention_heads} MLA, "
                         f"{config.linear_attn_config.num_heads} KDA) and the MLP and vocabulary widths")
    ep = ep or math.gcd(gpus, config.num_experts)
    if gpus % ep or config.num_experts % ep:
        raise ValueError(f"--ep {ep} must divide --gpus {gpus} and the number of experts {config.num_experts}")
    experts = split = whole = 0
    for name, _, nbytes, how in tensors:
        if ".experts.w" in name:
            experts += nbytes
        elif how is not None and tp > 1 and (layout == "tp" or ".self_attn." not in name):
            split += nbytes
        else:
            whole += nbytes
    n_moe = sum(config.is_moe(l) for l in range(config.num_hidden_layers))
    per_expert = experts // max(n_moe * config.num_experts, 1)
    la = config.linear_attn_config
    working = 2 * (12 * config.hidden_size + 8 * la.num_heads * la.head_dim + config.num_experts_per_token
                   * (config.routed_expert_hidden_size + 3 * config.moe_intermediate_size))
    parts = {
        # one layer's MoonEP replicas in flight (at most E/ep experts; none on one EP rank)
        "routed experts (MXFP4, 1/ep + replicas)": experts // ep + (ep > 1) * (config.num_experts // ep) * per_expert,
        "dense weights split over tp": split // tp,
        "dense weights whole on every GPU": whole,
        "activations (prefill chunk, logits)": prefill_chunk * working + DECODE_ROWS * config.vocab_size * 4,
        "runtime reserve": RUNTIME_RESERVE,
    }
    # a TP group shares its sequences: each GPU keeps every latent and 1/tp of the KDA heads; under data-parallel
    # attention each GPU serves its own sequences
    tp_cache = tp if layout == "tp" else 1
    per_token, seq_bytes = cache_bytes_per_token_and_sequence(config, tp_cache)
    groups = gpus // tp_cache
    plan = ServePlan(gpus, ep, tp, layout, gpu_memory, context, experts + split + whole, parts, per_token, seq_bytes)
    plan.sequences = max(plan.cache_bytes, 0) // (context * per_token + seq_bytes) * groups
    return plan


def _tp_ok(config: K3Config, tensors: list, tp: int) -> bool:
    """Whether tp divides both head counts and every width tensor parallelism splits."""
    if config.num_attention_heads % tp or config.linear_attn_config.num_heads % tp:
        return False
    return all(how is None or how[1] or shape[how[0]] % tp == 0 for _, shape, _, how in tensors)


def smallest_serve(config: K3Config, gpu_memory: int, context: int = 131072, layout: str | None = None,
                   tp: int | None = None, max_gpus: int = 4096, **kwargs) -> ServePlan | None:
    """The fewest GPUs that hold the model and at least one sequence of `context` tokens (ep = gcd(gpus,
    experts)); among the layouts that fit at that count, the one holding the most sequences."""
    tensors = _serve_tensors(config)
    for gpus in range(1, max_gpus + 1):
        fits = []
        for lay in ([layout] if layout else SERVE_LAYOUTS):
            for t in ([tp] if tp else (8, 4, 2, 1)):
                if gpus % t == 0 and _tp_ok(config, tensors, t):
                    p = plan_serve(config, gpus, gpu_memory, context, tp=t, layout=lay, _tensors=tensors, **kwargs)
                    if p.fits:
                        fits.append(p)
        if fits:
            return max(fits, key=lambda p: (p.sequences, p.tp))
    return None


def format_serve(plans: list[ServePlan], smallest: ServePlan | None) -> str:
    """A table: one column per plan (per-GPU bytes, capacity), then the smallest layout that fits."""
    if not plans:
        return "no layout"
    p0 = plans[0]
    head = [f"{p.layout}, tp {p.tp}, ep {p.ep}" for p in plans]
    lines = [f"serving on {p0.gpus} GPUs of {_gb(p0.gpu_memory)} at {p0.context:,} tokens of context; whole model "
             f"{_gb(p0.weight_bytes)} (MXFP4 experts)",
             f"  {'per GPU':<40}" + "".join(f"{h:>26}" for h in head)]
    for name in p0.parts:
        lines.append(f"  {name:<40}" + "".join(f"{_gb(p.parts[name]):>26}" for p in plans))
    rows = [("KV + KDA-state room (< 0: short by)", lambda p: _gb(p.cache_bytes)),
            ("MLA latents per token", lambda p: f"{p.token_bytes:,} B"),
            ("KDA states per sequence", lambda p: f"{p.sequence_bytes / 1e6:,.1f} MB"),
            ("sequences at this context", lambda p: f"{p.sequences:,}"),
            ("tokens in cache", lambda p: f"{p.tokens:,}"),
            ("fits", lambda p: "yes" if p.fits else "NO")]
    for name, f in rows:
        lines.append(f"  {name:<40}" + "".join(f"{f(p):>26}" for p in plans))
    if smallest is None:
        lines.append("  no GPU count up to the search limit holds the model and one sequence")
    else:
        lines.append(f"  smallest: {smallest.gpus} GPUs ({smallest.layout}, tp {smallest.tp}, ep {smallest.ep}): "
                     f"{smallest.sequences:,} sequences of {smallest.context:,} tokens")
    return "\n".join(lines)
