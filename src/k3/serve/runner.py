"""Runs one engine step through the model: flattens the scheduled chunks into one row [1, N] and lets the
model's own KDA and MLA modules read and write the pool through a BatchCacheView."""
from __future__ import annotations

import torch

from k3.model.cache import BatchCacheView, KDAState
from k3.serve.block_pool import CachePool
from k3.serve.sequence import Sequence


class PagedBatchView(BatchCacheView):
    """S sequences' views into the pool: KDA state rows by slot, MLA latents by block table. Everything the
    step needs is built here from host lists and sent in one copy per group (see BatchCacheView.upload)."""

    def __init__(self, pool: CachePool, num_layers: int, seqs: list[Sequence], lens: list[int]):
        dev = pool.device
        self.pool, self.num_layers, self.seq_len = pool, num_layers, 0
        self.set_layout(lens, [s.num_computed + n for s, n in zip(seqs, lens)], dev)
        bs = pool.block_size
        width = max(len(s.block_table) for s in seqs)
        tables = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))]
        slot_mapping = [s.block_table[p // bs] * bs + p % bs
                        for s, n in zip(seqs, lens) for p in range(s.num_computed, s.num_computed + n)]
        self.slots, tables_t, self.slot_mapping = self.upload([[s.slot for s in seqs], tables, slot_mapping], dev)
        self.block_tables = tables_t.view(len(seqs), width)

    def kda_state(self, layer_idx: int) -> KDAState:
        conv = self.pool.conv[layer_idx][self.slots]  # [S, 3, W−1, C]
        return KDAState(self.pool.state[layer_idx][self.slots], conv[:, 0], conv[:, 1], conv[:, 2])

    def set_kda_state(self, layer_idx: int, st: KDAState) -> None:
        self.pool.state[layer_idx][self.slots] = st.state.to(torch.float32)
        self.pool.conv[layer_idx][self.slots] = torch.stack([st.conv_q, st.conv_k, st.conv_v], 1).to(torch.float32)

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor) -> None:
        kv = self.pool.kv[layer_idx]
        kv.view(-1, kv.shape[-1])[self.slot_mapping] = torch.cat([latent, k_extra], -1).to(kv.dtype)

    def mla_context(self, layer_idx: int, rows: torch.Tensor, max_len: int):
        kv = self.pool.kv[layer_idx]
        nb = -(-max_len // self.pool.block_size)
        ctx = kv[self.block_tables[rows, :nb]].flatten(1, 2)[:, :max_len]  # [n, max_len, R + rope]
        R = self.pool.latent_dim
        return ctx[..., :R], ctx[..., R:], self.kv_len[rows]


class ModelRunner:
    def __init__(self, model, pool: CachePool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], lens: list[int], sample_rows: list[int]) -> torch.Tensor:
        """Feed seqs[i].tokens[num_computed : num_computed + lens[i]] for every i; return the last-token
        logits [len(sample_rows), vocab] of the rows that will sample. Does not advance num_computed."""
        ids = [t for s, n in zip(seqs, lens) for t in s.tokens[s.num_computed:s.num_computed + n]]
        view = PagedBatchView(self.pool, self.model.config.num_hidden_layers, seqs, lens)
        last = [view.cu_host[r + 1] - 1 for r in sample_rows]  # each sampling row's last token
        ids_t, last_t = view.upload([ids, last], self.device)
        ids_t = ids_t[None]
        embeds = None
        if any(s.mm for s in seqs):  # splice image rows over the <|media_pad|> positions this chunk covers
            embeds = self.model.model.embed_tokens(ids_t)
            offset = 0
            for s, n in zip(seqs, lens):
                lo, hi = s.num_computed, s.num_computed + n
                for start, rows, _ in s.mm:
                    a, b = max(lo, start), min(hi, start + rows.shape[0])
                    if a < b:
                        embeds[0, offset + a - lo:offset + b - lo] = rows[a - start:b - start].to(embeds.dtype)
                offset += n
        h = self.model.model(ids_t, cache=view, inputs_embeds=embeds)
        return self.model.lm_head(h[0, last_t])
