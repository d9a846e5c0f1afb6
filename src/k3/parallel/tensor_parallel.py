"""Tensor parallelism for serving (Megatron's split, inference only): a built K3 becomes one rank's shard.

Which tensor splits along which dim is k3.checkpoint.sharded's rule (`tp_slice`): KDA and MLA by heads, the dense
MLP and shared experts by intermediate width, the embedding and lm_head by vocabulary; everything else (norms,
router, AttnRes, the MLA/KDA low-rank latents, the latent MoE projections, the routed experts) stays whole. What
this module adds is the communication where a split ends:
  o_proj, down_proj  row-parallel: each rank's partial product, summed by one all-reduce;
  embed_tokens       vocabulary-parallel lookup (zeros outside the rank's block), summed by one all-reduce;
  lm_head            vocabulary-parallel logits, all-gathered into the full vocabulary on every rank.
The mixers keep their one forward: they read their head counts from the module (`num_heads`), which is set to
the local count here. The serving pool follows (`tensor_parallel_size(model)`: KDA state [slots, H/T, K, V] per
rank; MLA's latent cache is per token, shared by all heads, so it stays whole on every rank).

The collectives are the plain in-place ones (no autograd): a TP model is frozen (`requires_grad_(False)`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3.checkpoint.sharded import RankLayout, RankShard, load_rank_shard, tp_slice
from k3.config import K3Config
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiHeadLatentAttention
from k3.ops.mx_experts import pack_experts_
from k3.parallel.comm import all_gather


class _ShardLinear(nn.Linear):
    """A bias-free, frozen nn.Linear around this rank's block of a weight, and the group its ranks share."""

    def __init__(self, weight: torch.Tensor, group):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_parameter("bias", None)
        self.group = group


class RowParallelLinear(_ShardLinear):
    """`x @ Wᵀ` over this rank's block of input features; the ranks' partial outputs summed by one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """The rows [start, start + V/T) of the embedding: ids outside them give zeros, the all-reduce fills them in
    (exactly: every id is found on one rank, the others add zeros)."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int, group):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = vocab_size, weight.shape[1]
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(_ShardLinear):
    """Logits of this rank's vocabulary block, all-gathered so that every rank holds the full [..., V]."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = F.linear(h, self.weight)
        lead, block = part.shape[:-1], part.shape[-1]
        if part.numel() == 0:  # (every rank sees the same rows, so all skip together)
            return part.new_empty(*lead, block * dist.get_world_size(self.group))
        gathered = all_gather(part.reshape(-1, block), self.group)  # [T·N, V/T], rank-major
        return gathered.view(-1, *part.reshape(-1, block).shape).transpose(0, 1).reshape(*lead, -1)


def tensor_parallel_size(model: nn.Module) -> int:
    """T of a model made by this module (1 for any other model): what the serving pool divides KDA heads by."""
    return getattr(model, "tensor_parallel_size", 1)


def check_heads(config: K3Config, tp: int) -> None:
    """One-line ValueError naming the head counts when `tp` does not divide them."""
    mla, kda = config.num_attention_heads, config.linear_attn_config.num_heads
    if mla % tp or kda % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the attention heads: {mla} MLA heads "
                         f"(num_attention_heads), {kda} KDA heads (linear_attn_config.num_heads)")


def _group_layout(group) -> RankLayout:
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs an initialised torch.distributed process group")
    return RankLayout(tp_rank=dist.get_rank(group), tp=dist.get_world_size(group))


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, group=None) -> nn.Module:
    """Turn a full K3ForCausalLM (every rank holding the same weights) into this rank's TP shard of `group`
    (default: the world), in place; returns the model, frozen and in eval mode. To read only the rank's blocks
    of a checkpoint instead, use `load_tensor_parallel` (or `model_from_rank_shard`)."""
    from k3.model.decoder import K3ForCausalLM

    if not isinstance(model, K3ForCausalLM):
        raise TypeError(f"apply_tensor_parallel takes a K3ForCausalLM, got {type(model).__name__}")
    if tensor_parallel_size(model) > 1:  # slicing a rank's block again would cut it into pieces of pieces
        raise ValueError(f"the model is already tensor parallel (size {tensor_parallel_size(model)})")
    layout = _group_layout(group)
    _shard_modules(model, layout, group, take=lambda name, t, cut: t.narrow(cut[0], cut[1], cut[2] - cut[1]).clone())
    return model


def _shard_modules(model: nn.Module, layout: RankLayout, group, take) -> None:
    """Replace every TP-split parameter by `take(name, full, (dim, start, stop))`, swap in the row/vocabulary
    parallel modules and set the mixers' local head counts. Every size is checked before anything changes."""
    config, tp = model.config, layout.tp
    check_heads(config, tp)
    params = dict(model.named_parameters())
    cuts = {n: tp_slice(n, tuple(p.shape), config, layout) for n, p in params.items()}
    model.requires_grad_(False).eval()  # inference only: the collectives below carry no gradients
    if tp == 1:
        model.tensor_parallel_size = 1
        return
    modules = dict(model.named_modules())
    for name, cut in cuts.items():
        if cut is None:
            continue
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        block = take(name, params[name].detach(), cut)
        if isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding(block, cut[1], config.vocab_size, group)
        elif owner == "lm_head":
            new = VocabParallelLMHead(block, group)
        elif cut[0] == 1 and isinstance(module, nn.Linear):  # o_proj, down_proj: split along their input
            new = RowParallelLinear(block, group)
        else:  # column/head split: the module keeps its identity (FusedLinears hold it), its weight shrinks
            setattr(module, attr, nn.Parameter(block, requires_grad=False))
            continue
        parent_name, _, child = owner.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    for m in model.modules():
        if isinstance(m, (KimiDeltaAttention, MultiHeadLatentAttention)):
            m.num_heads //= tp
    model.tensor_parallel_size = tp


@torch.no_grad()
def model_from_rank_shard(config: K3Config, shard: RankShard, group=None) -> nn.Module:
    """A TP model of `group` holding exactly the tensors of `shard` (from `load_rank_shard` with this rank's
    RankLayout): shaped on the meta device, then every parameter and buffer is the shard's tensor itself.
    The routed experts are the shard's stacks as loaded (all of them when shard.layout.ep == 1). group=None
    with a shard of tp == 1: no tensor parallelism (an expert-parallel rank's model, k3.serve.expert_shard)."""
    from k3.model.decoder import K3ForCausalLM

    layout = RankLayout() if group is None and shard.layout.tp == 1 else _group_layout(group)
    if (shard.layout.tp_rank, shard.layout.tp) != (layout.tp_rank, layout.tp):
        raise ValueError(f"the shard was loaded for TP rank {shard.layout.tp_rank} of {shard.layout.tp}, but this "
                         f"process is TP rank {layout.tp_rank} of {layout.tp}")
    with torch.device("meta"):
        model = K3ForCausalLM(config, init=False)
    if any(n.endswith("_packed") for n in shard.tensors):
        for m in model.modules():
            if hasattr(m, "w1") and hasattr(m, "packed"):
                pack_experts_(m, empty=True)
    _shard_modules(model, layout, group, take=lambda name, t, cut: t.narrow(cut[0], cut[1], cut[2] - cut[1]))
    modules = dict(model.named_modules())
    targets = list(model.state_dict(keep_vars=True).items())
    missing = sorted(set(n for n, _ in targets) - set(shard.tensors))
    if missing:
        raise ValueError(f"the rank shard lacks {len(missing)} tensors of the model, e.g. {missing[0]}")
    for name, meta in targets:
        t = shard.tensors[name]
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        is_stack = ".experts." in name
        if not is_stack and tuple(t.shape) != tuple(meta.shape):
            raise ValueError(f"{name}: the shard holds {list(t.shape)}, TP rank {layout.tp_rank} of {layout.tp} "
                             f"needs {list(meta.shape)}")
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    return model


def load_tensor_parallel(path, group=None, device="cpu", dtype: torch.dtype | str | None = None,
                         packed_experts: bool = False) -> nn.Module:
    """This rank's TP model of checkpoint `path`, reading only its own blocks (`load_rank_shard`)."""
    layout = _group_layout(group)
    config = K3Config.from_pretrained(path)
    check_heads(config, layout.tp)
    shard = load_rank_shard(path, layout, device=device, dtype=dtype, packed_experts=packed_experts)
    return model_from_rank_shard(config, shard, group)
