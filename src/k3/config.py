"""K3Config: the released `text_config` fields under their own names, presets, and validation."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field holds a value k3 cannot build; the message names the field and what is allowed."""


def mla_layers_for(num_layers: int, period: int = 4) -> list[int]:
    """1-indexed full-attention layers of K3's schedule: every `period`-th layer plus the last one."""
    return sorted({l + 1 for l in range(num_layers) if (l + 1) % period == 0} | {num_layers})


@dataclass
class LinearAttnConfig:
    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True
    full_attn_layers: list[int] = field(default_factory=lambda: mla_layers_for(93))
    kda_layers: list[int] = field(default_factory=lambda: [l for l in range(1, 94) if l not in mla_layers_for(93)])


@dataclass
class K3Config:
    """Hyper-parameters of the text model, named exactly as in the released `text_config`."""

    model_type: str = "kimi_linear"
    architectures: list[str] = field(default_factory=lambda: ["KimiLinearForCausalLM"])
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    vocab_size: int = 163840
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    attn_res_block_size: int = 12
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586  # where generation stops (a list: any of them)
    pad_token_id: int | None = 163839
    dtype: str = "bfloat16"
    initializer_range: float = 0.02
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    quantization_config: dict | None = None
    # Fields of a loaded config.json that k3 does not interpret; kept so that writing it back loses nothing.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.linear_attn_config, dict):
            known = {f.name for f in fields(LinearAttnConfig)}
            la = dict(self.linear_attn_config)
            self._la_extra = {k: v for k, v in la.items() if k not in known}
            self.linear_attn_config = LinearAttnConfig(**{k: v for k, v in la.items() if k in known})
        elif not isinstance(self.linear_attn_config, LinearAttnConfig):
            raise ConfigError(f"invalid config field linear_attn_config={self.linear_attn_config!r}: must be an "
                              f"object with {', '.join(f.name for f in fields(LinearAttnConfig))}")
        self.validate()

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def mla_layer_ids(self) -> set[int]:
        """0-based indices of the MLA (full attention) layers."""
        return {l - 1 for l in self.linear_attn_config.full_attn_layers}

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layer_ids

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts are fused into one MLP of this width (2 × 3072 = 6144 in K3)."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ---- validation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, name: str, allowed: str):
            if not cond:
                raise ConfigError(f"invalid config field {name}={getattr_path(self, name)!r}: {allowed}")

        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_experts",
                     "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                     "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "attn_res_block_size", "moe_layer_freq"):
            need(_is_int(getattr(self, name)) and getattr(self, name) > 0, name,
                 "must be a positive integer (below 2^31)")
        for name in ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        # Real-valued fields are type-checked first so that a JSON string or null names its field instead of
        # failing later as "'>' not supported between 'str' and 'int'".
        for name in ("activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "routed_scaling_factor",
                     "linear_attn_config.gate_lower_bound"):
            need(_is_real(getattr_path(self, name)), name, "must be a finite number")
        # JSON has no int/bool confusion, but "true" (a string) is truthy: every flag must be a real boolean
        for name in ("latent_moe_use_norm", "moe_renormalize", "use_grouped_topk", "mla_use_nope",
                     "mla_use_output_gate", "tie_word_embeddings", "linear_attn_config.use_full_rank_gate"):
            need(isinstance(getattr_path(self, name), bool), name,
                 "must be true or false (a JSON boolean, not a string)")
        need(_is_int(self.max_position_embeddings) and self.max_position_embeddings > 0, "max_position_embeddings",
             "must be a positive integer")
        need(_is_real(self.initializer_range) and self.initializer_range > 0, "initializer_range",
             "must be a number > 0")
        need(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        need(self.model_type == "kimi_linear", "model_type", "'kimi_linear' (the text_config of a kimi_k3 model)")
        need(isinstance(self.architectures, list) and all(isinstance(a, str) for a in self.architectures),
             "architectures", "a list of class names")
        need(not self.tie_word_embeddings, "tie_word_embeddings",
             "only false is supported: K3 keeps lm_head separate from embed_tokens")
        need(self.mla_use_output_gate, "mla_use_output_gate",
             "only true (K3's MLA has a sigmoid output gate) is supported")
        for name in ("bos_token_id", "pad_token_id"):
            tid = getattr(self, name)
            need(tid is None or (_is_int(tid) and 0 <= tid < self.vocab_size), name,
                 f"a token id in [0, vocab_size={self.vocab_size}) or null")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        need(eos == [None] or (eos and all(_is_int(t) and 0 <= t < self.vocab_size for t in eos)), "eos_token_id",
             f"a token id (or a list of them) in [0, vocab_size={self.vocab_size}) or null")
        q = self.quantization_config
        need(q is None or (isinstance(q, dict) and q.get("format") == "mxfp4-pack-quantized"), "quantization_config",
             "absent/null (unquantized) or compressed-tensors with format 'mxfp4-pack-quantized' (MXFP4 experts)")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"must be <= num_experts ({self.num_experts})")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             f"must equal num_attention_heads ({self.num_attention_heads}); K3's MLA has no grouped KV heads")
        need(self.hidden_act == "situ", "hidden_act", "only 'situ' (SiTU-GLU) is supported")
        need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func", "only 'sigmoid' is supported")
        need(self.topk_method == "noaux_tc", "topk_method", "only 'noaux_tc' is supported")
        need(self.num_expert_group == 1 and self.topk_group == 1, "num_expert_group",
             "only one expert group (num_expert_group = topk_group = 1) is supported")
        need(self.mla_use_nope, "mla_use_nope", "only true (K3's MLA is NoPE) is supported")
        need(self.num_nextn_predict_layers == 0, "num_nextn_predict_layers", "only 0 is supported")
        need(self.activation_situ_beta > 0, "activation_situ_beta", "must be > 0")
        need(self.activation_situ_linear_beta > 0, "activation_situ_linear_beta", "must be > 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        la = self.linear_attn_config
        need(_is_int(la.num_heads) and la.num_heads > 0, "linear_attn_config.num_heads", "must be a positive integer")
        need(_is_int(la.head_dim) and la.head_dim > 0, "linear_attn_config.head_dim", "must be a positive integer")
        need(_is_int(la.short_conv_kernel_size) and la.short_conv_kernel_size >= 1,
             "linear_attn_config.short_conv_kernel_size", "must be an integer >= 1")
        need(la.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "must be < 0 (the decay gate lies in (lower_bound, 0))")
        need(la.use_full_rank_gate, "linear_attn_config.use_full_rank_gate", "only true is supported")
        L = self.num_hidden_layers
        for name in ("full_attn_layers", "kda_layers"):
            layers = getattr(la, name)
            need(isinstance(layers, (list, tuple)) and all(_is_int(x) and 1 <= x <= L for x in layers),
                 f"linear_attn_config.{name}", f"a list of 1-indexed layer numbers in 1..{L}")
        full, kda = set(la.full_attn_layers), set(la.kda_layers)
        need(not (full & kda) and (full | kda) == set(range(1, L + 1)), "linear_attn_config.kda_layers",
             "together with full_attn_layers, every layer 1..num_hidden_layers exactly once")
        # Each field below 2^31 still lets a weight of three of them pass int64 (torch: "Storage size calculation
        # overflowed", from deep inside the model's build); the released model's largest holds 2e10 elements.
        H = self.num_attention_heads
        weights = {"embed_tokens": self.vocab_size * self.hidden_size,
                   "the routed experts' stack": self.num_experts * self.moe_intermediate_size
                   * self.routed_expert_hidden_size,
                   "the dense MLP": self.intermediate_size * self.hidden_size,
                   "MLA's q_b_proj": H * (self.qk_nope_head_dim + self.qk_rope_head_dim) * self.q_lora_rank,
                   "MLA's kv_b_proj": H * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank,
                   "MLA's o_proj": H * self.v_head_dim * self.hidden_size,
                   "KDA's projections": la.num_heads * la.head_dim * self.hidden_size}
        name, numel = max(weights.items(), key=lambda kv: kv[1])
        if numel > MAX_WEIGHT_ELEMENTS:
            raise ConfigError(f"invalid config: {name} would hold {numel:,} elements, more than 2^40; its sizes "
                              f"are not a model's")

    # ---- (de)serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in ("extra", "linear_attn_config")}
        d["linear_attn_config"] = {**asdict(self.linear_attn_config), **getattr(self, "_la_extra", {})}
        if d["quantization_config"] is None:
            del d["quantization_config"]
        d.update(copy.deepcopy(self.extra))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "K3Config":
        """Accepts a bare text config or a top-level K3 config holding `text_config`."""
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(d).__name__}")
        where = ""
        if "text_config" in d:
            top, d, where = d, d["text_config"], "text_config."
            if not isinstance(d, dict):
                raise ConfigError(f"invalid config field text_config={d!r}: must be an object")
            d = dict(d)
            for name in _SHARED_TOP_LEVEL:  # the released config repeats these at both levels
                if name in top and name in d and top[name] != d[name]:
                    raise ConfigError(f"config field {name} is {top[name]!r} at the top level but {d[name]!r} in "
                                      f"text_config; make them agree")
                if name in top and name not in d:
                    d[name] = top[name]
        if "dtype" not in d and "torch_dtype" in d:  # the name transformers used before 4.56
            d["dtype"] = d["torch_dtype"]
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in sorted(known - _OPTIONAL) if k not in d]
        la = d.get("linear_attn_config")
        if isinstance(la, dict):
            missing += [f"linear_attn_config.{f.name}" for f in fields(LinearAttnConfig) if f.name not in la]
        if missing:
            raise ConfigError(f"config is missing field{'s' * (len(missing) > 1)} "
                              f"{', '.join(where + m for m in missing)} (k3 takes no model size from defaults)")
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known}
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as e:  # a field of the wrong JSON type
            raise ConfigError(f"bad config: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "K3Config":
        """Reads `config.json` (top level with `text_config`, or a bare text config) or a directory holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_hf_dict(self) -> dict:
        """The top-level released layout: `KimiK3ForConditionalGeneration` wrapping this text config."""
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.to_dict(),
            "dtype": self.dtype,
        }

    def save(self, path: str | Path) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        p.write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "K3Config":
        d = self.to_dict()
        la = changes.pop("linear_attn_config", None)
        d.update(changes)
        if la is not None:
            d["linear_attn_config"] = {**d["linear_attn_config"], **la}
        return K3Config.from_dict(d)

    # ---- presets ------------------------------------------------------------------------------------
    PRESETS = ("kimi-k3", "k3-shaped", "tiny", "small", "scale-out")

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        if name == "kimi-k3":
            return cls(quantization_config=copy.deepcopy(_K3_QUANTIZATION_CONFIG))
        if name == "k3-shaped":  # the released model cut to 4 layers: 3 KDA + 1 MLA, layer 0 dense
            return cls.preset("kimi-k3").replace(
                num_hidden_layers=4, linear_attn_config={"full_attn_layers": mla_layers_for(4), "kda_layers": [1, 2, 3]})
        if name == "tiny":
            return _scaled(num_layers=6, hidden=128, heads=4, head_dim=32, vocab=8192, dense_inter=384,
                           experts=16, topk=4, expert_inter=64, q_lora=64, kv_lora=32, rope=16, block=3)
        if name == "small":
            return _scaled(num_layers=16, hidden=1536, heads=12, head_dim=128, vocab=32768, dense_inter=6144,
                           experts=64, topk=8, expert_inter=512, q_lora=384, kv_lora=256, rope=64, block=4)
        if name == "scale-out":
            # for 2-4 GPUs, where expert and context parallelism are meant to pay: few, wide experts (each
            # token-slot's 3 GEMMs are 6·L·I = 25 MFLOP per 2 KiB of latent it sends, ~9× small's) and, at
            # 32K+ tokens, attention that outweighs its all-gathered MLA latents
            return _scaled(num_layers=8, hidden=2048, heads=16, head_dim=128, vocab=32768, dense_inter=8192,
                           experts=32, topk=8, expert_inter=4096, q_lora=512, kv_lora=512, rope=64, block=4)
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(cls.PRESETS)}")


# The float dtypes a checkpoint's weights may be stored in (config field `dtype`).
DTYPES = ("bfloat16", "float16", "float32", "float64")
# Fields a config.json may leave out: none of them sets a size, and their defaults hold for any K3-shaped model.
_OPTIONAL = frozenset({"model_type", "architectures", "quantization_config", "initializer_range",
                       "tie_word_embeddings"})
# Fields the released top level repeats beside text_config.
_SHARED_TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "dtype", "torch_dtype")


MAX_WEIGHT_ELEMENTS = 2**40  # one weight tensor of a config: 4 TB in float32


def _is_int(v) -> bool:
    """An int (JSON's true is not one) that a tensor's size can be: JSON has no bound, torch's sizes are int64 and
    10**30 would be a TypeError from deep inside the model's build."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**31 < v < 2**31


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def getattr_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _scaled(*, num_layers, hidden, heads, head_dim, vocab, dense_inter, experts, topk, expert_inter,
            q_lora, kv_lora, rope, block) -> K3Config:
    """A K3-shaped model: 3:1 KDA:MLA with a terminal MLA, dense layer 0, latent = hidden/2, 2 shared experts."""
    full = mla_layers_for(num_layers)
    return K3Config(
        hidden_size=hidden, num_hidden_layers=num_layers, vocab_size=vocab, intermediate_size=dense_inter,
        num_experts=experts, num_experts_per_token=topk, moe_intermediate_size=expert_inter,
        routed_expert_hidden_size=hidden // 2, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=head_dim, qk_rope_head_dim=rope,
        v_head_dim=head_dim, attn_res_block_size=block, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        dtype="float32",
        linear_attn_config=LinearAttnConfig(
            num_heads=heads, head_dim=head_dim, full_attn_layers=full,
            kda_layers=[l for l in range(1, num_layers + 1) if l not in full]),
    )


_K3_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
