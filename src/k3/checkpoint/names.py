"""The mapping between k3's module tree and the released tensor names, shapes and dtypes (SPEC §2)."""
from __future__ import annotations

import math
import re

import torch

PREFIX = "language_model."
# The only tensors the released checkpoint keeps in F32; everything else is BF16.
_F32_PATTERNS = (r"conv1d\.weight$", r"\.A_log$", r"\.dt_bias$", r"o_norm\.weight$", r"e_score_correction_bias$")
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(w[123])$")
_EXPERT_FILE_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def is_f32(name: str) -> bool:
    return any(re.search(p, name) for p in _F32_PATTERNS)


def a_log_len(num_heads: int) -> int:
    """The released A_log holds the per-head values padded with zeros to a multiple of 128 (96 → 128)."""
    return math.ceil(num_heads / 128) * 128


def export_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype | None):
    """k3 state dict → (released name, tensor) pairs: per-expert split, A_log padded, dtypes as released.

    dtype: the dtype of the non-F32 tensors (bf16 as released; None keeps each tensor's own dtype)."""
    for name, t in state.items():
        t = t.detach()
        m = _EXPERT_RE.match(name)
        cast = torch.float32 if is_f32(name) else (dtype or t.dtype)
        if m:
            for e in range(t.shape[0]):
                yield f"{PREFIX}{m.group(1)}.{e}.{m.group(2)}.weight", t[e].to(cast).contiguous()
        elif name.endswith("A_log"):
            padded = t.new_zeros(a_log_len(t.shape[0]), dtype=torch.float32)
            padded[: t.shape[0]] = t
            yield PREFIX + name, padded
        else:
            yield PREFIX + name, t.to(cast).contiguous()


def parse_name(name: str):
    """Released name → (k3 name, expert index or None, expert tensor kind or None). Prefix optional."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    m = _EXPERT_FILE_RE.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2)), m.group(4)
    return name, None, None
