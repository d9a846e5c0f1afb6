"""The K3 decoder: layers of (KDA | MLA) + (dense MLP | LatentMoE) wired by Block AttnRes, and the LM head."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.config import K3Config
from k3.memory import check_fits
from k3.model.attn_res import BlockGrads, attn_res_mix_norm, attn_res_mix_norm_route, residual_add
from k3.model.cache import K3Cache, StaticCache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.model.mlp import SiTUMLP
from k3.model.moe import LatentMoE
from k3.model.norm import RMSNorm
from k3.ops.cross_entropy import cross_entropy
from k3.ops.gemv import DecodeLinear
from k3.ops.host_sync import host_reads_forbidden


@dataclass
class K3Output:
    logits: torch.Tensor  # [B, T, vocab]
    loss: torch.Tensor | None = None


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_mla = config.is_mla(layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = (MultiHeadLatentAttention if self.is_mla else KimiDeltaAttention)(config, layer_idx)
        if config.is_moe(layer_idx):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = SiTUMLP(config, D, config.intermediate_size)

    def ffn(self, x: torch.Tensor, mask: torch.Tensor | None, routing: tuple | None = None) -> torch.Tensor:
        """The FFN of x; `routing`: the MoE's (idx, weights, scores) of x where the mix before it routed x too."""
        return self.block_sparse_moe(x, mask, routing=routing) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        D = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(K3DecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        # Training forwards keep only each layer's inputs and recompute the layer in backward.
        self.gradient_checkpointing = False

    def forward(self, input_ids, doc_ids=None, cache=None, mask=None, inputs_embeds=None) -> torch.Tensor:
        """SPEC §3.1's layer loop. Returns the final normed hidden states [B, T, D].
        inputs_embeds: [B, T, D] used instead of `embed_tokens(input_ids)` (the multimodal model splices image
        rows into them); input_ids still give the shape."""
        block = self.config.attn_res_block_size
        blocks: list[torch.Tensor] = []
        p = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        recompute = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        # each block's gradient summed in one buffer by the mixes that read it, not by autograd's pairwise adds
        block_grads = BlockGrads() if BlockGrads.wanted() else None
        # Each layer's `p + ffn` is left to the next mix, whose kernel does the add with it (inference:
        # k3.ops._attn_res_norm_triton, training: k3.ops._attn_res_triton's; one launch fewer a layer), and
        # attaches the sum to BlockGrads; a checkpointed layer adds its own.
        defer = not recompute
        ffn = None  # the last layer's FFN output, not yet added to p
        for l, layer in enumerate(self.layers):
            starts_block = l % block == 0
            if starts_block and block_grads is not None and ffn is None:  # (a deferred sum is attached by its mix)
                p = block_grads.attach(p)
            if recompute:
                p_next = _checkpointed_layer(layer, starts_block, p, blocks, doc_ids, mask)
            else:
                p, p_next, ffn = _layer_forward(layer, starts_block, p, blocks, doc_ids, mask, cache, add=ffn)
                if not defer:
                    p_next, ffn = residual_add(p_next, ffn), None  # p + ffn; see BlockGrads
            if starts_block:
                blocks.append(p)
            p = p_next
        return attn_res_mix_norm(blocks, p, self.output_attn_res_norm, self.output_attn_res_proj, self.norm,
                                 add=ffn)[1]


def _layer_forward(layer: K3DecoderLayer, starts_block: bool, p: torch.Tensor, blocks: list[torch.Tensor],
                   doc_ids, mask, cache=None, add: torch.Tensor | None = None):
    """One layer of SPEC §3.1's loop: (its incoming partial sum p + add, the partial sum after its mixer, its FFN's
    output); the partial sum after layer l is the sum of the last two. `add`: the previous layer's FFN output where
    the caller left it to this layer's first mix (never at layer 0). `blocks` is read, never changed; when
    `starts_block` the caller appends the incoming partial sum to it."""
    # each mix is read only through the norm after it; each also takes the residual add before it
    if blocks:
        p_sum, x = attn_res_mix_norm(blocks, p, layer.self_attention_res_norm, layer.self_attention_res_proj,
                                     layer.input_layernorm, add=add)
        p = p if add is None else p_sum  # (without add, p as before: training's BlockGrads attach it later)
    else:
        assert add is None, "layer 0 has no mix to take the add"
        x = layer.input_layernorm(p)
    if starts_block:
        blocks = blocks + [p]
    attn = layer.self_attn(x, doc_ids=doc_ids, cache=cache)
    # a new block's partial sum starts at 0; before a MoE the mix may route its output in the same launch
    p_mid, m, routing = attn_res_mix_norm_route(blocks, None if starts_block else p, layer.mlp_res_norm,
                                                layer.mlp_res_proj, layer.post_attention_layernorm, attn,
                                                getattr(layer, "block_sparse_moe", None))
    return p, p_mid, layer.ffn(m, mask, routing)


def _checkpointed_layer(layer: K3DecoderLayer, starts_block: bool, p: torch.Tensor, blocks: list[torch.Tensor],
                        doc_ids, mask) -> torch.Tensor:
    """`_layer_forward` keeping only its inputs; backward runs it again. The MoE router scores it records for
    the load balancer are those of the forward: a recomputation restores whatever they were before it, so the
    balancer sees each batch once whether it reads them before or after backward."""
    moe = getattr(layer, "block_sparse_moe", None)
    calls = 0

    def run(p, *blocks):
        nonlocal calls
        calls += 1
        kept = (moe.last_scores, moe.last_mask) if moe is not None and calls > 1 else None
        try:
            _, p_mid, ffn = _layer_forward(layer, starts_block, p, list(blocks), doc_ids, mask)
            return residual_add(p_mid, ffn)  # p + ffn; see BlockGrads
        finally:
            if kept is not None:
                moe.last_scores, moe.last_mask = kept

    return checkpoint(run, p, *blocks, use_reentrant=False)


def contiguous_segments(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids → a segment counter that changes exactly where the id changes, so that every op
    (attention masks by equality, KDA and conv split at changes) sees the same documents even when an id repeats."""
    change = torch.zeros_like(doc_ids)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(doc_ids.dtype)
    return change.cumsum(1)


class K3ForCausalLM(nn.Module):
    """Kimi K3's text model. Parameter names are the released checkpoint's (without `language_model.`)."""

    def __init__(self, config: K3Config, init: bool = True):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"config must be a K3Config, got {type(config).__name__}")
        device = torch.get_default_device()
        if device.type != "meta":  # refuse a model that cannot fit before allocating any of it
            dtype = torch.get_default_dtype()
            check_fits(f"K3ForCausalLM({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
                       f"{config.vocab_size}) with {K3ForCausalLM.parameter_count(config):,} "
                       f"{str(dtype).removeprefix('torch.')} parameters",
                       K3ForCausalLM.parameter_bytes(config, dtype), device)
        self.config = config
        self.model = K3Model(config)
        self.lm_head = DecodeLinear(config.hidden_size, config.vocab_size, bias=False)
        if init and not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ---- Hugging Face-shaped introspection ------------------------------------------------------------
    @staticmethod
    def parameter_count(config: K3Config) -> int:
        """Parameters of a model of this config (counted on the meta device: nothing is allocated)."""
        with torch.device("meta"):
            return sum(p.numel() for p in K3ForCausalLM(config, init=False).parameters())

    @staticmethod
    def parameter_bytes(config: K3Config, dtype: torch.dtype) -> int:
        """Bytes of a model of this config with float parameters in `dtype` (plus its buffers), unallocated."""
        with torch.device("meta"):
            m = K3ForCausalLM(config, init=False)
        size = torch.empty((), dtype=dtype, device="meta").element_size()
        return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in m.parameters()) + \
            sum(b.numel() * b.element_size() for b in m.buffers())

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As in transformers: all parameters, or only those requiring grad, optionally without the token
        embedding (the LM head is a matmul and is counted)."""
        skip = {id(self.model.embed_tokens.weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))

    @property
    def device(self) -> torch.device:
        """The device of the parameters (a model is on one device; parallel wrappers shard it from outside)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of the weights; the few tensors the release keeps in F32 (A_log, dt_bias, router
        bias, ...) stay float32 under a bf16 model and do not count."""
        from k3.checkpoint.names import is_f32
        return next((p.dtype for n, p in self.named_parameters() if p.is_floating_point() and not is_f32(n)),
                    self.model.embed_tokens.weight.dtype)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) matrices; unit norms; zero AttnRes queries (each mix starts as a mean);
        KDA decay rates spread over (−1, −0.01) at init so that memories of many lengths exist from the start."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("res_proj.weight"):
                p.zero_()
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                rate = torch.exp(torch.empty(p.shape).uniform_(math.log(0.01), math.log(1.0), generator=gen))
                frac = rate / -self.config.linear_attn_config.gate_lower_bound
                p.copy_(torch.log(frac) - torch.log1p(-frac))  # sigmoid(dt_bias) = rate / 5
            elif "conv1d" in name:
                w = p.shape[-1]
                p.copy_(torch.empty(p.shape).uniform_(-w ** -0.5, w ** -0.5, generator=gen))
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None, cache: K3Cache | None = None,
                labels: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0) -> K3Output:
        """input_ids: [B, T] int64. doc_ids: [B, T] for packed rows (documents never see each other).
        cache: a K3Cache to continue from and update (decode / chunked prefill). labels: [B, T], −100 = ignore.
        mask: [B, T] bool, False marks padding (kept out of the balancing statistics).
        inputs_embeds: [B, T, D] replacing the token embeddings (see K3Model.forward).
        logits_to_keep: > 0 computes logits for the last that many positions only (prefill needs one)."""
        self._check_inputs(input_ids, doc_ids, cache, labels, mask)
        if inputs_embeds is not None and tuple(inputs_embeds.shape) != (*input_ids.shape, self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be [batch, seq, hidden] = {(*input_ids.shape, self.config.hidden_size)}, "
                             f"got {tuple(inputs_embeds.shape)}")
        if doc_ids is not None:
            doc_ids = contiguous_segments(doc_ids)
        if logits_to_keep < 0 or (logits_to_keep and labels is not None):
            raise ValueError(f"logits_to_keep must be >= 0 and cannot be combined with labels, got {logits_to_keep}")
        h = self.model(input_ids, doc_ids=doc_ids, cache=cache, mask=mask, inputs_embeds=inputs_embeds)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        loss = None
        if labels is not None:
            loss = cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return K3Output(logits=logits, loss=loss)

    def _check_inputs(self, input_ids, doc_ids, cache, labels, mask):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, seq] tensor, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty (sequence length 0)")
        # The range check reads the ids on the host, which a CUDA graph capture forbids and which would split a
        # compiled graph (the graphed decode feeds back its own sampled tokens, always in range).
        if input_ids.numel() and not host_reads_forbidden(input_ids) and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, vocab_size={self.config.vocab_size}); got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        for name, t in (("doc_ids", doc_ids), ("labels", labels), ("mask", mask)):
            if t is not None and tuple(t.shape) != tuple(input_ids.shape):
                raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(t.shape)}")
        if doc_ids is not None and cache is not None:
            raise ValueError("packed input (doc_ids) cannot be combined with a decode cache")
        if getattr(cache, "batch", None) not in (None, input_ids.shape[0]):  # a StaticCache has a fixed batch
            raise ValueError(f"the cache holds {cache.batch} rows, input_ids has {input_ids.shape[0]}")
        if cache is not None and cache.num_layers != self.config.num_hidden_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, model has {self.config.num_hidden_layers}")

    def new_cache(self, batch: int | None = None, max_len: int | None = None) -> K3Cache:
        """A growing K3Cache, or with `batch` and `max_len` a preallocated StaticCache on the model's device
        (the form a CUDA-graphed decode needs)."""
        if max_len is None:
            return K3Cache(self.config.num_hidden_layers)
        w = self.model.embed_tokens.weight
        return StaticCache(self.config, batch, max_len, device=w.device, dtype=w.dtype,
                           tp=getattr(self, "tensor_parallel_size", 1))  # (a TP rank holds its KDA heads only)

    # ---- generation and checkpoints live in their own modules --------------------------------------------
    def generate(self, input_ids, **kwargs):
        from k3.model.generate import generate
        return generate(self, input_ids, **kwargs)

    def save_pretrained(self, path, dtype: torch.dtype | None = torch.bfloat16, **kwargs) -> None:
        from k3.checkpoint.hf import save_pretrained
        if getattr(self, "tensor_parallel_size", 1) > 1:  # refused before anything is written
            raise ValueError(f"this model is one rank of tensor parallelism of size {self.tensor_parallel_size} and "
                             f"holds only its blocks of the weights: save the full model instead")
        save_pretrained(self, path, dtype=dtype, **kwargs)

    @classmethod
    def from_pretrained(cls, path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                        **kwargs) -> "K3ForCausalLM":
        """Load a checkpoint directory. dtype: a torch dtype or its name ("bfloat16"), "auto" for the config's
        `dtype`, None for float32 (the F32 tensors of the release stay float32 in every case). `torch_dtype`
        is accepted as transformers' older name of `dtype`; `packed_experts=True` keeps MXFP4 experts packed."""
        from k3.checkpoint.hf import load_pretrained
        if "torch_dtype" in kwargs:
            if dtype is not None:
                raise TypeError("from_pretrained: give dtype or torch_dtype, not both")
            dtype = kwargs.pop("torch_dtype")
        if "device_map" in kwargs:
            raise TypeError("from_pretrained: device_map is not supported; pass device='cuda:0' (a model lives on "
                            "one device; k3.parallel shards it)")
        unknown = sorted(set(kwargs) - {"packed_experts", "stats"})
        if unknown:
            raise TypeError(f"from_pretrained got unexpected keyword argument(s) {', '.join(unknown)}; it takes "
                            f"device, dtype, packed_experts, stats")
        return load_pretrained(path, device=device, dtype=dtype, **kwargs)
