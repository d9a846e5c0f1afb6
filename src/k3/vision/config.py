"""VisionConfig: the released `vision_config` fields under their own names (SPEC §7), presets, validation."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields

from k3.config import ConfigError


def _default_media_proc_cfg() -> dict:
    return {"in_patch_limit": 65536, "patch_limit_on_one_side": 512, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5]}


@dataclass
class VisionConfig:
    """MoonViT-V2 + `patchmergerv2` projector. Defaults are the released Kimi K3 values."""

    model_type: str = "moonvit3d"
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536            # heads × head dim; not the width
    vt_intermediate_size: int = 4096
    vt_hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 4096             # merged width: vt_hidden_size × 2 × 2
    projector_hidden_act: str = "gelu"     # exact (erf) GELU
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    media_proc_cfg: dict = field(default_factory=_default_media_proc_cfg)
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.media_proc_cfg = {**_default_media_proc_cfg(), **(self.media_proc_cfg or {})}
        self.validate()

    # ---- derived ----------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def pad_multiple(self) -> int:
        """Image sides are zero-padded to multiples of patch × merge kernel (28 px as released)."""
        return self.patch_size * self.merge_kernel_size[0]

    @property
    def in_patch_limit(self) -> int:
        return self.media_proc_cfg["in_patch_limit"]

    @property
    def max_side(self) -> int:
        """Largest side after resizing: patch_limit_on_one_side × patch (7168 px as released)."""
        return self.media_proc_cfg["patch_limit_on_one_side"] * self.patch_size

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond, name, allowed):
            if not cond:
                raise ConfigError(f"invalid vision_config field {name}={getattr(self, name, None)!r}: {allowed}")

        for name in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "vt_num_hidden_layers",
                     "vt_hidden_size", "vt_num_attention_heads", "qkv_hidden_size", "vt_intermediate_size",
                     "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "must be a positive integer")
        need(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
             f"must be a multiple of vt_num_attention_heads ({self.vt_num_attention_heads})")
        need(self.head_dim % 4 == 0, "qkv_hidden_size", "head dim must be a multiple of 4 (2D RoPE uses pairs of pairs)")
        need(self.merge_kernel_size == [2, 2] or list(self.merge_kernel_size) == [2, 2], "merge_kernel_size",
             "only [2, 2] is supported")
        self.merge_kernel_size = list(self.merge_kernel_size)
        need(self.mm_hidden_size == self.vt_hidden_size * self.merge_area, "mm_hidden_size",
             f"must equal vt_hidden_size × 4 = {self.vt_hidden_size * self.merge_area}")
        need(self.vt_hidden_act == "gelu_pytorch_tanh", "vt_hidden_act", "only 'gelu_pytorch_tanh' is supported")
        need(self.projector_hidden_act == "gelu", "projector_hidden_act", "only 'gelu' (exact erf GELU) is supported")
        need(self.pos_emb_interpolation_mode == "bilinear", "pos_emb_interpolation_mode", "only 'bilinear' is supported")
        need(self.mm_projector_type == "patchmergerv2", "mm_projector_type", "only 'patchmergerv2' is supported")
        need(isinstance(self.projector_ln_eps, (int, float)) and self.projector_ln_eps > 0, "projector_ln_eps",
             "must be a positive number")
        need(isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0,
             "rope_theta", "must be a positive number")
        m = self.media_proc_cfg
        for key in ("in_patch_limit", "patch_limit_on_one_side"):
            v = m.get(key)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"invalid vision_config field media_proc_cfg.{key}={v!r}: must be a positive integer")

    # ---- (de)serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}
        d.update(copy.deepcopy(self.extra))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"vision_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        try:
            return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})
        except TypeError as e:
            raise ConfigError(f"bad vision_config: {e}") from None

    def replace(self, **changes) -> "VisionConfig":
        return VisionConfig.from_dict({**self.to_dict(), **changes})

    # ---- presets ------------------------------------------------------------------------------------------
    PRESETS = ("kimi-k3", "tiny")

    @classmethod
    def preset(cls, name: str, text_hidden_size: int | None = None) -> "VisionConfig":
        """"kimi-k3": the released config. "tiny": a 2-block, width-64 tower for CPU tests and training."""
        if name == "kimi-k3":
            cfg = cls()
        elif name == "tiny":
            cfg = cls(init_pos_emb_height=8, init_pos_emb_width=8, vt_num_hidden_layers=2, vt_hidden_size=64,
                      vt_num_attention_heads=4, qkv_hidden_size=64, vt_intermediate_size=128, mm_hidden_size=256,
                      text_hidden_size=128)
        else:
            raise ConfigError(f"unknown vision preset {name!r}; choose one of {', '.join(cls.PRESETS)}")
        return cfg if text_hidden_size is None else cfg.replace(text_hidden_size=text_hidden_size)
