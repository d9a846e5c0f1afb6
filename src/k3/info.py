"""`k3 info`: parameter breakdown, activated parameters, cache and checkpoint sizes, from a meta-device build."""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from k3.checkpoint.names import a_log_len, is_f32
from k3.config import K3Config
from k3.parallel.memory_plan import cache_bytes_per_token_and_sequence

# component name → regex over k3 parameter names; the first match wins.
_COMPONENTS = OrderedDict([
    ("embedding", r"^model\.embed_tokens\."),
    ("lm_head", r"^lm_head\."),
    ("routed experts", r"\.experts\.w[123]$"),
    ("latent projections + norm", r"\.routed_expert_(down_proj|up_proj|norm)\."),
    ("routers", r"\.block_sparse_moe\.gate\."),
    ("shared experts", r"\.shared_experts\."),
    ("dense MLP", r"\.mlp\.(gate|up|down)_proj\."),
    ("KDA mixers", r"KDA"),  # resolved per layer below
    ("MLA mixers", r"MLA"),
    ("AttnRes", r"res_(norm|proj)\."),
    ("norms", r"(layernorm|^model\.norm)\."),
])


def _checkpoint_numel(name: str, t: torch.Tensor) -> int:
    """Count as the released file stores it (A_log is zero-padded to 128 entries)."""
    return a_log_len(t.shape[0]) if name.endswith("A_log") else t.numel()


def model_report(config: K3Config) -> dict:
    from k3.model.decoder import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    mla = config.mla_layer_ids
    parts = OrderedDict((k, 0) for k in _COMPONENTS)
    bf16_bytes = mxfp4_bytes = total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = _checkpoint_numel(name, t)
        total += n
        m = re.match(r"^model\.layers\.(\d+)\.self_attn\.", name)
        if m:
            part = "MLA mixers" if int(m.group(1)) in mla else "KDA mixers"
        else:
            part = next(k for k, rx in _COMPONENTS.items() if k not in ("KDA mixers", "MLA mixers") and re.search(rx, name))
        parts[part] += n
        width = 4 if is_f32(name) else 2
        bf16_bytes += n * width
        # MXFP4: half a byte per value plus one E8M0 scale byte per 32 values (routed experts only).
        mxfp4_bytes += n // 2 + n // 32 if part == "routed experts" else n * width
    n_moe = sum(config.is_moe(l) for l in range(config.num_hidden_layers))
    per_expert = 3 * config.moe_intermediate_size * config.routed_expert_hidden_size
    inactive = n_moe * (config.num_experts - config.num_experts_per_token) * per_expert
    n_mla, n_kda = len(mla), config.num_hidden_layers - len(mla)
    mla_per_token, kda_per_sequence = cache_bytes_per_token_and_sequence(config)  # the serving pool's arithmetic
    return {
        "total": total,
        "activated": total - inactive - parts["embedding"],  # the embedding is a lookup, not a matmul
        "components": dict(parts),
        "layers": {"kda": n_kda, "mla": n_mla, "dense": config.num_hidden_layers - n_moe, "moe": n_moe},
        "mla_cache_bytes_per_token_bf16": mla_per_token,
        "kda_state_bytes_per_sequence": kda_per_sequence,
        "checkpoint_bytes_bf16": bf16_bytes,
        "checkpoint_bytes_mxfp4_experts": mxfp4_bytes,
    }


def _human(n: float, unit: str = "") -> str:
    for s in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:,.2f} {s}{unit}".strip()
        n /= 1000
    return f"{n:,.2f} P{unit}"


def format_report(name: str, config: K3Config, r: dict) -> str:
    lines = [f"{name}: {config.num_hidden_layers} layers ({r['layers']['kda']} KDA + {r['layers']['mla']} MLA; "
             f"{r['layers']['dense']} dense + {r['layers']['moe']} MoE), hidden {config.hidden_size}, "
             f"vocab {config.vocab_size}, {config.num_experts} experts top-{config.num_experts_per_token}",
             f"  {'component':<28}{'parameters':>22}{'share':>9}"]
    for k, v in r["components"].items():
        lines.append(f"  {k:<28}{v:>22,}{100 * v / r['total']:>8.2f}%")
    lines += [
        f"  {'total':<28}{r['total']:>22,}",
        f"  {'activated per token':<28}{r['activated']:>22,}",
        f"  MLA latent cache per token (bf16): {r['mla_cache_bytes_per_token_bf16']:,} B",
        f"  KDA state per sequence (fp32 state + conv tails): {r['kda_state_bytes_per_sequence']:,} B "
        f"({_human(r['kda_state_bytes_per_sequence'], 'B')})",
        f"  checkpoint, all bf16: {_human(r['checkpoint_bytes_bf16'], 'B')}; "
        f"with MXFP4 routed experts: {_human(r['checkpoint_bytes_mxfp4_experts'], 'B')}",
    ]
    return "\n".join(lines)
