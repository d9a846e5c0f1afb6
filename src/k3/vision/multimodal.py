"""K3ForConditionalGeneration: the K3 text model plus MoonViT-V2 and the projector. A prompt carries
`<|media_begin|>image {W}x{H}<|media_content|>` + N × `<|media_pad|>` + `<|media_end|>` per image; the pad
positions' embeddings are replaced, in order, by the projector rows (SPEC §7). Parameter names are the
released ones: `language_model.*`, `vision_tower.*`, `mm_projector.*`."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from k3.config import ConfigError, K3Config
from k3.model.decoder import K3ForCausalLM, K3Output
from k3.vision.config import VisionConfig
from k3.vision.preprocess import ImageInput, batch_images
from k3.vision.projector import PatchMergerProjector, merge_patches
from k3.vision.tower import MoonViT

MEDIA_PLACEHOLDER_TOKEN_ID = 163605  # `<|media_pad|>` in the released tokenizer


class K3ForConditionalGeneration(nn.Module):
    """Text model + vision. `config` is the text K3Config (so the serving engine can drive it like the text
    model: `.model`, `.lm_head`, `.config` are the language model's)."""

    def __init__(self, config: K3Config, vision_config: VisionConfig,
                 media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID, init: bool = True):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"config must be a K3Config, got {type(config).__name__}")
        if not isinstance(vision_config, VisionConfig):
            raise TypeError(f"vision_config must be a VisionConfig, got {type(vision_config).__name__}")
        if vision_config.text_hidden_size != config.hidden_size:
            raise ConfigError(f"vision_config.text_hidden_size ({vision_config.text_hidden_size}) must equal the text "
                              f"model's hidden_size ({config.hidden_size})")
        if not (isinstance(media_placeholder_token_id, int) and 0 <= media_placeholder_token_id < config.vocab_size):
            raise ConfigError(f"media_placeholder_token_id must be a token id in [0, {config.vocab_size}), got "
                              f"{media_placeholder_token_id!r}")
        self.config, self.vision_config = config, vision_config
        self.media_placeholder_token_id = media_placeholder_token_id
        self.language_model = K3ForCausalLM(config, init=init)
        self.vision_tower = MoonViT(vision_config)
        self.mm_projector = PatchMergerProjector(vision_config)
        if init and not any(p.is_meta for p in self.parameters()):
            self.reset_vision_parameters()

    # the text model's parts, for code written against K3ForCausalLM (serving engine, generate)
    @property
    def model(self):
        return self.language_model.model

    @property
    def lm_head(self):
        return self.language_model.lm_head

    def new_cache(self, batch: int | None = None, max_len: int | None = None):
        return self.language_model.new_cache(batch, max_len)

    @torch.no_grad()
    def reset_vision_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices, conv and the position grid; ones for norms."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for module in (self.vision_tower, self.mm_projector):
            for _, p in module.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    # ---- images ----------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor, attn=None) -> torch.Tensor:
        """pixel_values: [N, 3, P, P]; grid_thws: [n, 3] → projector rows [M, hidden_size], image after image."""
        dev = self.mm_projector.post_norm.weight.device
        feats = self.vision_tower(pixel_values.to(dev), grid_thws, attn=attn)
        return self.mm_projector(merge_patches(feats, grid_thws))

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """Preprocessed images → [Σ num_tokens, hidden_size]."""
        return self.encode_images(*batch_images(images))

    def splice(self, input_ids: torch.Tensor, image_rows: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, T, D] with the `<|media_pad|>` positions replaced, in row-major order, by
        image_rows [M, D]. M must equal the number of pads."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        pads = input_ids == self.media_placeholder_token_id
        n = int(pads.sum())
        m = 0 if image_rows is None else image_rows.shape[0]
        if n != m:
            raise ValueError(f"input_ids hold {n} <|media_pad|> tokens (id {self.media_placeholder_token_id}) but the "
                             f"images give {m} rows; each image needs exactly num_image_tokens pads")
        if n == 0:
            return embeds
        return embeds.masked_scatter(pads[..., None], image_rows.to(embeds.dtype))

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None, labels: torch.Tensor | None = None, cache=None,
                doc_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None) -> K3Output:
        """input_ids: [B, T]; pixel_values/grid_thws: every image of the batch, in the order their pads appear
        (row-major over [B, T]); or image_rows [M, D] already encoded. labels: [B, T] (targets, −100 = ignore);
        image positions and targets are ignored."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, seq] tensor")
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pixel_values and grid_thws come together (both or neither)")
        if pixel_values is not None and image_rows is not None:
            raise ValueError("give pixel_values/grid_thws or image_rows, not both")
        if pixel_values is not None:
            image_rows = self.encode_images(pixel_values, grid_thws)
        embeds = self.splice(input_ids, image_rows)
        if labels is not None:
            pad = self.media_placeholder_token_id
            labels = labels.masked_fill((input_ids == pad) | (labels == pad), -100)
        return self.language_model(input_ids, doc_ids=doc_ids, cache=cache, labels=labels, mask=mask,
                                   inputs_embeds=embeds)

    # ---- generation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def stream_generate(self, input_ids: torch.Tensor, images: list[ImageInput] | None = None,
                        max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int | None = None, eos_token_id: int | None = None) -> Iterator[torch.Tensor]:
        """Prefill the prompt (with its images) once, then decode through the cache; yields tokens [B]. The
        arguments are checked and the images encoded when called, before the first token is asked for."""
        from k3.model.generate import check_sampling, stream_generate

        check_sampling(temperature, top_k, top_p)  # before the tower runs: a bad argument costs no encode
        rows = self.encode(images) if images else None
        prefill = lambda ids, cache: self(ids, image_rows=rows, cache=cache).logits  # noqa: E731
        return stream_generate(self.language_model, input_ids, max_new_tokens, temperature, top_k, top_p,
                               seed, eos_token_id, prefill=prefill)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save_pretrained(self, path, dtype: torch.dtype | None = torch.bfloat16, **kwargs) -> None:
        from k3.vision.checkpoint import save_pretrained
        save_pretrained(self, path, dtype=dtype, **kwargs)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype: torch.dtype | None = None,
                        packed_experts: bool = False) -> "K3ForConditionalGeneration":
        from k3.vision.checkpoint import load_pretrained
        return load_pretrained(path, device=device, dtype=dtype, packed_experts=packed_experts)


def image_token_ids(tokenizer, image: ImageInput) -> list[int]:
    """`<|media_begin|>image {W}x{H}<|media_content|>` + num_tokens × `<|media_pad|>` + `<|media_end|>`."""
    sp = tokenizer.special_tokens
    W, H = image.size
    return [sp["<|media_begin|>"], *tokenizer.encode(f"image {W}x{H}"), sp["<|media_content|>"],
            *[sp["<|media_pad|>"]] * image.num_tokens, sp["<|media_end|>"]]


def vision_parameter_count(vision_config: VisionConfig) -> dict:
    """{"vision_tower": n, "mm_projector": n, "tensors": (tower tensors, projector tensors)} from a meta build."""
    with torch.device("meta"):
        tower, proj = MoonViT(vision_config), PatchMergerProjector(vision_config)
    return {"vision_tower": sum(p.numel() for p in tower.parameters()),
            "mm_projector": sum(p.numel() for p in proj.parameters()),
            "tensors": (len(tower.state_dict()), len(proj.state_dict()))}


def load_model(path, device="cpu", dtype: torch.dtype | None = None, keep_mxfp4: bool = False):
    """A model directory → K3ForConditionalGeneration if its config.json has a vision_config, else K3ForCausalLM.
    keep_mxfp4: a checkpoint's MXFP4 experts stay packed (unquantized experts are never packed here: that would
    quantize them)."""
    from k3.checkpoint.convert import config_experts_format
    from k3.config import K3Config
    from k3.vision.checkpoint import has_vision
    packed_experts = keep_mxfp4 and config_experts_format(K3Config.from_pretrained(path)) == "mxfp4"
    if has_vision(path):
        return K3ForConditionalGeneration.from_pretrained(path, device=device, dtype=dtype,
                                                          packed_experts=packed_experts)
    return K3ForCausalLM.from_pretrained(path, device=device, dtype=dtype, packed_experts=packed_experts)
