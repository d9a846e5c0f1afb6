"""Context parallelism for KDA and MLA layers, applied from outside: each rank of a CP group holds one
contiguous shard of every sequence, and the mixers run their own forward over a shard-aware layout (the
`cache` argument of their forward) that supplies the short convs' halo, the KDA core's incoming state and
MLA's gathered context.

KDA (SPEC §5): over its shard a rank's effect on the state is affine, S_out = M_r S_in + S̃_r. One
`kda_chunk` pass with the values widened by K zero columns and the initial state [0 | I] yields all of it at
once: the final state is [S̃_r | M_r] and the extra output columns are p_t = scale · M_{≤t}ᵀ q_t, so the
true output is o_t = o⁰_t + S_inᵀ p_t. The (M_r, S̃_r) pairs are all-gathered and prefix-scanned for S_in;
no second pass is needed. The short convs read the previous shard's last W−1 projected inputs (a halo).
MLA: the normalised latent and k_extra of the whole sequence are all-gathered; local queries attend causally to
the keys up to the shard's end. Packed documents (doc_ids) are supported: the document of the shard's first token
decides whether the incoming state and halo apply, and MLA attends with each document that meets the shard one
varlen segment (k3.ops.varlen_attention.packed_documents), no [B, T, S] mask.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3.model.kda import KimiDeltaAttention, doc_ids_to_cu_seqlens
from k3.model.mla import MultiHeadLatentAttention
from k3.ops.attention import causal_attention
from k3.ops.conv import short_conv
from k3.ops.kda_core import kda_core
from k3.ops.varlen_attention import document_attention, packed_documents
from k3.parallel.comm import all_gather


def shard_bounds(seq_len: int, cp: int) -> list[tuple[int, int]]:
    """Contiguous shards, sizes differing by at most one (the first seq_len % cp are longer)."""
    if cp > seq_len:
        raise ValueError(f"context parallel size {cp} is larger than the sequence length {seq_len}: "
                         f"every rank needs at least one token")
    base, extra = divmod(seq_len, cp)
    bounds, start = [], 0
    for r in range(cp):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


class ContextParallelState:
    """What the shard-aware mixers of one forward share: group, shard bounds and global document segments."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bounds: list[tuple[int, int]] = []
        self.segments: torch.Tensor | None = None  # [B, T] global contiguous segment ids, or None

    def begin(self, seq_len: int, segments: torch.Tensor | None) -> tuple[int, int]:
        """Set up one forward over sequences of global length seq_len; returns this rank's (start, end)."""
        self.bounds = shard_bounds(seq_len, self.size)
        self.segments = segments
        return self.bounds[self.rank]

    @property
    def local_segments(self) -> torch.Tensor | None:
        if self.segments is None:
            return None
        s, e = self.bounds[self.rank]
        return self.segments[:, s:e]

    def halo(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The `width` inputs just before this shard, zeros before the sequence start. x: [B, T_r, C] →
        [B, width, C]. Each rank shares its last `width` rows; several ranks contribute when shards are short.
        The halo is cut from the gathered rows by slices at offsets known from the shard bounds (no index
        tensor to build and copy to the device), and always from that one table, so that every rank's result
        depends on the gather (whose backward every rank must join)."""
        B, T, C = x.shape
        mine = x[:, -width:] if T >= width else torch.cat([x.new_zeros(B, width - T, C), x], dim=1)
        gathered = all_gather(mine.transpose(0, 1), self.group)  # [R·width, B, C]: rank j's block at j·width
        table = torch.cat([gathered.new_zeros(width, B, C), gathered], dim=0)  # zeros first: before the start
        pieces, need = [], width
        for j in range(self.rank - 1, -1, -1):  # the shards before mine, nearest first, until width rows
            s, e = self.bounds[j]
            take = min(need, e - s)
            end = width + (j + 1) * width  # block j ends here in table; its real rows are the last e − s
            pieces.insert(0, table[end - take:end])
            need -= take
            if not need:
                break
        if need:
            pieces.insert(0, table[width - need:width])
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).transpose(0, 1)

    def halo_segments(self, width: int) -> torch.Tensor | None:
        """Global segment ids of the halo positions, −1 before the sequence start. [B, width]."""
        if self.segments is None:
            return None
        start = self.bounds[self.rank][0]
        pad = F.pad(self.segments, (width, 0), value=-1)
        return pad[:, start:start + width]

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """All shards of x: [B, T_r, F] → [B, T, F] (shards padded to equal length for the gather, the padding
        cut off again by slices)."""
        B, T, Fdim = x.shape
        longest = max(e - s for s, e in self.bounds)
        padded = torch.cat([x, x.new_zeros(B, longest - T, Fdim)], dim=1) if T < longest else x
        gathered = all_gather(padded.transpose(0, 1), self.group).view(self.size, longest, B, Fdim)
        if all(e - s == longest for s, e in self.bounds):
            return gathered.flatten(0, 1).transpose(0, 1)
        return torch.cat([gathered[r, :e - s] for r, (s, e) in enumerate(self.bounds)]).transpose(0, 1)


def _incoming_state(summaries: torch.Tensor, rank: int, V: int) -> torch.Tensor:
    """Prefix scan of the gathered [R, B, H, K, V+K] = [S̃_r | M_r]: S_in(0) = 0, S_in(r+1) = M_r S_in(r) + S̃_r.

    All R incoming states are formed and this rank's is picked from the stack, so every rank's result depends
    on the gathered tensor (its backward is a collective every rank must join)."""
    state = torch.zeros_like(summaries[0][..., :V])
    states = [state]
    for r in range(summaries.shape[0] - 1):
        state = summaries[r][..., V:] @ state + summaries[r][..., :V]
        states.append(state)
    return torch.stack(states)[rank]


class ContextParallelKDA:
    """KDA layout of one rank's shard (training/prefill; no decode cache): convs over the halo, and the core
    run once with widened values so that its final state is the shard's affine summary."""

    def __init__(self, cp: ContextParallelState):
        self.cp = cp

    def short_convs(self, m: KimiDeltaAttention, xs: list[torch.Tensor]):
        cp, W = self.cp, m.q_conv1d.weight.shape[-1]
        seg = cp.local_segments
        halo = cp.halo(torch.cat(xs, dim=-1), W - 1).split([x.shape[-1] for x in xs], dim=-1)
        halo_seg = cp.halo_segments(W - 1)
        convs = []
        for x, h, conv in zip(xs, halo, m.convs):
            if seg is None:
                y, _ = short_conv(x, conv.weight, h, silu=True)
            else:  # prepend the halo as real rows so the document mask covers it too
                y, _ = short_conv(torch.cat([h.to(x.dtype), x], 1), conv.weight, None, torch.cat([halo_seg, seg], 1),
                                  silu=True)
                y = y[:, W - 1:]
            convs.append(y)
        return convs, None

    def core(self, m: KimiDeltaAttention, q, k, v, f, beta_logits, tails) -> torch.Tensor:
        cp = self.cp
        B, T, H, K = q.shape
        V = v.shape[-1]
        seg = cp.local_segments
        params = (m.A_log, m.dt_bias, m.lower_bound)
        v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        eye = torch.eye(K, dtype=sdt, device=q.device)
        if seg is None:
            init = torch.zeros(B, H, K, V + K, dtype=sdt, device=q.device)
            init[..., V:] = eye
            o_aug, summary = kda_core(q, k, v_aug, f, beta_logits, *params, initial_state=init,
                                      output_final_state=True)
        else:
            halo_seg = cp.halo_segments(m.q_conv1d.weight.shape[-1] - 1)
            cu = doc_ids_to_cu_seqlens(seg)
            starts = cu[:-1]
            row_first = torch.searchsorted(starts, torch.arange(B, device=cu.device) * T)
            row_last = torch.cat([row_first[1:], row_first.new_tensor([starts.numel()])]) - 1
            continues = seg[:, 0] == halo_seg[:, -1]  # the row's first document began on an earlier rank
            init = torch.zeros(starts.numel(), H, K, V + K, dtype=sdt, device=q.device)
            # (a product, not init[row_first[continues]]: a boolean mask would read the device back)
            init[row_first, :, :, V:] = eye * continues[:, None, None, None]
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
            o_aug, final = kda_core(*map(flat, (q, k, v_aug, f, beta_logits)), *params, initial_state=init,
                                    output_final_state=True, cu_seqlens=cu)
            o_aug = o_aug.view(B, T, H, V + K)
            summary = final[row_last]
        s_in = _incoming_state(all_gather(summary[None], cp.group), cp.rank, V)  # [B, H, K, V]
        return o_aug[..., :V] + torch.einsum("bthk,bhkv->bthv", o_aug[..., V:].to(sdt), s_in).to(o_aug.dtype)


class ContextParallelMLA:
    """MLA layout of one rank's shard: local queries over the gathered latent KV of the whole sequence
    (training/prefill; no decode cache)."""

    def __init__(self, cp: ContextParallelState):
        self.cp = cp

    def attend(self, m: MultiHeadLatentAttention, q, latent, k_extra) -> torch.Tensor:
        cp, T = self.cp, q.shape[1]
        kv = cp.gather_sequence(torch.cat([latent, k_extra], dim=-1))
        start = cp.bounds[cp.rank][0]
        # no [B, T, S] mask (GBs at long context): the keys up to the shard's last query, expanded, and
        packing = None if cp.segments is None else packed_documents(cp.segments, q.device, start, T)
        if packing is None or packing.whole_rows:  # ... the shard's T queries the last of them: bottom-right causal
            k, v = m.expand_kv(*kv[:, :start + T].split([m.kv_rank, m.rope], dim=-1))
            return causal_attention(q, k, v, m.scale)
        # ... or with packed documents, each document that meets the shard a varlen segment (k3.ops.varlen_attention)
        k, v = m.expand_kv(*packing.pack_keys(kv).split([m.kv_rank, m.rope], dim=-1))
        return document_attention(q, k, v, m.scale, packing)


def _over_layout(forward, layout):
    """The mixer's own forward, run over `layout` instead of a cache (doc_ids: the global segments are in cp)."""
    def sharded(x, doc_ids=None, cache=None):
        if cache is not None:
            raise ValueError("context parallel mixers run training/prefill forwards only (cache must be None)")
        return forward(x, cache=layout)
    return sharded


def apply_context_parallel(model, group) -> ContextParallelState:
    """Run every KDA and MLA mixer in `model` over its shard-aware layout on `group` (their own forward,
    given the layout). Returns the shared state; the caller (k3.parallel.parallelize) calls `begin` before
    each forward."""
    cp = ContextParallelState(group)
    kda, mla = ContextParallelKDA(cp), ContextParallelMLA(cp)
    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            mod.forward = _over_layout(mod.forward, kda)
        elif isinstance(mod, MultiHeadLatentAttention):
            mod.forward = _over_layout(mod.forward, mla)
    return cp
