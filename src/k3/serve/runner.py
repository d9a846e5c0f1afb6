"""Runs one engine step through the model: flattens the scheduled chunks into one row [1, N] and lets the
model's own KDA and MLA modules read and write the pool through a BatchCacheView. Steps that only decode can
instead replay a CUDA graph captured for their padded batch size and block-table width (DecodeGraphs)."""
from __future__ import annotations

import array
import itertools
import logging
from dataclasses import dataclass
from itertools import chain

import torch

from k3.model.cache import BatchCacheView, KDASlots, KDAState
from k3.model.cuda_graph import wants_graphs
from k3.model.kda import KimiDeltaAttention
from k3.ops.fused_linear import fuse_projections, joined_columns
from k3.ops.kda_core import takes_graph_plan
from k3.ops.kda_fla_lean import CHUNK_SIZE, ChunkPlan, chunk_lists
from k3.ops.slot_rows import gather_slots, scatter_slots_
from k3.ops.triton_dispatch import on_device
from k3.serve.block_pool import CachePool
from k3.serve.prefill_graphs import PrefillGraphs, gc_paused
from k3.serve.sampling import score_rows
from k3.serve.sequence import Sequence
from k3.serve.staging import PinnedStaging

_log = logging.getLogger(__name__)

# Prompt positions scored per lm_head call: bounds the [rows, vocab] float32 logits a long chunk would make
# (2048 × 163,840 × 4 B = 1.3 GB at once; 256 rows: 168 MB).
SCORE_ROWS = 256


@dataclass
class PromptScores:
    """The prompt logprobs one step computed, from the same forward as its prefill chunks: for each scoring
    sequence a span (its index in the step, the prompt position of its first scored token, how many), and
    score_rows' tensors over all spans in order (top-k as wide as the widest request asks)."""
    spans: list[tuple[int, int, int]]
    targets: torch.Tensor  # [M] the scored prompt tokens
    chosen: torch.Tensor   # [M] their logprobs
    top_ids: torch.Tensor  # [M, K]
    top_lps: torch.Tensor  # [M, K]


def token_slots(seqs: list[Sequence], lens: list[int], block_size: int) -> list[int]:
    """The pool slot (block · block_size + offset) of each new token of the step, sequence after sequence."""
    return span_slots([(s.block_table, s.num_computed, s.num_computed + n) for s, n in zip(seqs, lens)], block_size)


def span_slots(spans: list[tuple[list[int], int, int]], block_size: int) -> list[int]:
    """The pool slots of positions [start, end) of each (block table, start, end), span after span: one range per
    block a span touches, flattened at C speed (a loop over tokens cost ~2 ms a 8,192-token step; torch's CPU ops
    on small index tensors cost up to ~0.6 ms each on the H200's host)."""
    runs = []
    for table, p, end in spans:
        while p < end:
            b, off = divmod(p, block_size)
            base = table[b] * block_size
            stop = min(end - p, block_size - off)
            runs.append(range(base + off, base + off + stop))
            p += stop
    return list(chain.from_iterable(runs))


class PagedBatchView(BatchCacheView):
    """S sequences' views into the pool: KDA state rows by slot, MLA latents by block table. Everything the
    step needs is built here from host lists and sent in one copy per group (see BatchCacheView.upload)."""

    kda_rows: torch.Tensor | None = None  # the leading rows whose KDA states move (k3.ops.slot_rows); None: all

    def __init__(self, pool: CachePool, num_layers: int, seqs: list[Sequence], lens: list[int]):
        dev = pool.device
        self.pool, self.num_layers, self.seq_len = pool, num_layers, 0
        self.slots_host = [s.slot for s in seqs]
        self.set_layout(lens, [s.num_computed + n for s, n in zip(seqs, lens)], dev)
        bs = pool.block_size
        width = max(len(s.block_table) for s in seqs)
        tables = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))]
        # one copy: the rows' slots, block tables, new tokens' pool slots and every prefill row's context slots
        # (row after row, as `mla_prefill_context` packs them)
        context = span_slots([(seqs[r].block_table, 0, self.kv_lens[r]) for r in self.prefill_rows], bs)
        self.slots, tables_t, self.slot_mapping, context_t = self.upload(
            [self.slots_host, tables, token_slots(seqs, lens, bs), context], dev)
        self.block_tables = tables_t.view(len(seqs), width)
        self.prefill_context_slots = context_t if self.prefill_rows else None

    def kda_state(self, layer_idx: int) -> KDAState:
        # a layer's short convs and its core both read it: gathered once, until the layer writes its state back
        kept = self._kda_read.get(layer_idx)
        if kept is not None:
            return kept
        conv = gather_slots(self.pool.conv[layer_idx], self.slots, self.kda_rows)  # [S, W−1, 3·C]: q, k, v tails
        st = KDAState(gather_slots(self.pool.state[layer_idx], self.slots, self.kda_rows), *conv.chunk(3, -1))
        self._kda_read[layer_idx] = st
        return st

    def forget_shared(self) -> None:
        super().forget_shared()
        self._kda_read = {}

    def set_kda_state(self, layer_idx: int, st: KDAState) -> None:
        self._kda_read.pop(layer_idx, None)
        scatter_slots_(self.pool.state[layer_idx], self.slots, st.state, self.kda_rows)
        # the short convs return the new tails as views of one [S, W−1, 3·C] tensor: written back as it is
        scatter_slots_(self.pool.conv[layer_idx], self.slots, joined_columns([st.conv_q, st.conv_k, st.conv_v]),
                       self.kda_rows)

    def kda_slots(self, layer_idx: int) -> KDASlots:
        conv = self.pool.conv[layer_idx]  # [slots, W−1, 3·C]
        return KDASlots(self.pool.state[layer_idx], *conv.chunk(3, -1), self.slots)

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor) -> None:
        kv = self.pool.kv[layer_idx]
        kv.view(-1, kv.shape[-1])[self.slot_mapping] = torch.cat([latent, k_extra], -1).to(kv.dtype)

    def mla_context(self, layer_idx: int, rows: torch.Tensor | slice, max_len: int):
        kv = self.pool.kv[layer_idx]
        nb = -(-max_len // self.pool.block_size)
        ctx = kv[self.block_tables[rows, :nb]].flatten(1, 2)[:, :max_len]  # [n, max_len, R + rope]
        R = self.pool.latent_dim
        return ctx[..., :R], ctx[..., R:], self.kv_len[rows]

    def mla_paged(self, layer_idx: int, rows: torch.Tensor):
        return self.pool.kv[layer_idx], self.block_tables[rows], self.kv_len[rows]

    def mla_prefill_context(self, layer_idx: int):
        kv = self.pool.kv[layer_idx]
        ctx = kv.view(-1, kv.shape[-1])[self.prefill_context_slots]  # [C, R + rope]
        return ctx.split([self.pool.latent_dim, kv.shape[-1] - self.pool.latent_dim], -1)


class DecodeGraphView(PagedBatchView):
    """A decode-only step of `rows` rows over block tables `width` blocks wide, its per-step inputs held in one
    static device buffer that `load` overwrites: the same tensors every step, so a CUDA graph can replay it.
    Rows past the real sequences read and write the pool's scratch slot and block, with a context of 1."""

    def __init__(self, pool: CachePool, num_layers: int, rows: int, width: int):
        self.pool, self.num_layers, self.seq_len = pool, num_layers, 0
        self.rows, self.width = rows, width
        self.set_layout([1] * rows, [width * pool.block_size] * rows, pool.device)  # decode_max_len = width blocks
        self.buf = torch.zeros(rows * (4 + width), dtype=torch.long, device=pool.device)
        self.staging = PinnedStaging(self.buf)
        self.ids, self.kv_len, self.slots, self.slot_mapping = self.buf[:4 * rows].view(4, rows)
        self.block_tables = self.buf[4 * rows:].view(rows, width)

    def load(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> None:
        """This step's token, length, slot, new-token position and block table of each sequence, one copy.
        ids: the tokens [len(seqs)] as a device tensor instead (async output: the previous step's picks, which
        the host has not read yet), written over the loaded column on the device."""
        pool, bs, rows, width = self.pool, self.pool.block_size, self.rows, self.width
        pad = rows - len(seqs)
        n = [s.num_computed for s in seqs]
        cols = [([0] * len(seqs) if ids is not None else [s.tokens[p] for s, p in zip(seqs, n)]) + [0] * pad,
                [p + 1 for p in n] + [1] * pad,
                [s.slot for s in seqs] + [pool.scratch_slot] * pad,
                [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, n)] + [pool.scratch_block * bs] * pad]
        tables = [b for s in seqs for b in s.block_table + [pool.scratch_block] * (width - len(s.block_table))]
        self.staging.load(torch.tensor([v for c in cols for v in c] + tables + [pool.scratch_block] * (pad * width)))
        if ids is not None:
            self.ids[:len(seqs)].copy_(ids)
        self._kda_read = {}  # (a forward cut short by an error may have left a layer's read)


class StaticKDAView(PagedBatchView):
    """The KDA layers' layout of a prefill-graph bucket of `tokens` tokens in fixed shapes, refilled in place before
    each step (`load`), so that a CUDA graph captures the KDA cores with the rest of the step: S = R + 2 documents
    (R = min(max_rows, tokens), as a row has a token at least: the step's rows, one pad document over the bucket's
    pad rows, empty ones after), each with a state slot (the pool's scratch slot for all but the step's rows), and
    fla's chunk plan padded to the most chunks a step of the bucket can cut, in fla's graph mode (its `use_graph`:
    spare rows name document −1, on which the chunk kernels return at once). Every document is a prefill row (a
    one-token row runs the chunked form: the same function). `kda_rows` counts the step's rows and the pad document:
    the states of the empty documents after them are neither read from nor written to the pool where
    k3.ops.slot_rows' kernels run."""

    def __init__(self, pool: CachePool, num_layers: int, tokens: int, max_rows: int):
        dev, S = pool.device, min(max_rows, tokens) + 2
        self.pool, self.num_layers, self.seq_len, self.tokens, self.S = pool, num_layers, 0, tokens, S
        self.nt = tokens // CHUNK_SIZE + S  # Σ ceil(len/64) <= tokens/64 + documents
        self.buf = torch.zeros(S + (S + 1) + 2 * self.nt + (S + 1) + 1, dtype=torch.long, device=dev)
        self.staging = PinnedStaging(self.buf)
        self.slots, self.cu_seqlens, pairs, offsets, rows = self.buf.split([S, S + 1, 2 * self.nt, S + 1, 1])
        self.kda_rows = rows[0]
        self.cu_cpu = torch.zeros(S + 1, dtype=torch.long)  # the offsets on the host (the CPU reference reads them)
        # the KDA cores' plan (`prefill_plan`): these buffers, not one made from the host offsets at capture
        self.prefill_plan = ChunkPlan(self.cu_seqlens, self.cu_cpu, pairs.view(self.nt, 2), offsets, graph=True)
        self.decode_rows, self.prefill_rows = [], list(range(S))
        self.prefill_span = (slice(0, S), slice(0, tokens))
        self.prefill_cu_seqlens, self.prefill_cu_seqlens_cpu = self.cu_seqlens, self.cu_cpu
        self.forget_shared()

    def load(self, lens: list[int], slots: list[int]) -> None:
        """The step's rows (new tokens and state slot of each, at most max_rows, tokens within the bucket)."""
        S, n = self.S, sum(lens)
        if len(lens) > S - 2 or n > self.tokens:
            raise ValueError(f"{len(lens)} rows of {n} tokens do not fit the layout of {S - 2} rows, {self.tokens} "
                             f"tokens")
        docs = [*lens, self.tokens - n] + [0] * (S - 1 - len(lens))
        cu = [0, *itertools.accumulate(docs)]
        pairs, offsets = chunk_lists(docs)
        pairs += [-1, 0] * (self.nt - len(pairs) // 2)  # fla's sentinel rows
        values = [*slots, *[self.pool.scratch_slot] * (S - len(slots)), *cu, *pairs, *offsets, len(lens) + 1]
        self.staging.load(torch.frombuffer(array.array("q", values), dtype=torch.long))
        self.cu_cpu.copy_(torch.tensor(cu))
        self.forget_shared()


class DecodeGraphs:
    """Decode-only steps replayed from CUDA graphs, one per (padded batch size, block-table width) and captured
    on first use. Batch sizes pad up to a power of two and widths to a power of two of blocks, so few graphs
    cover every step; a graph's attention reads its full width, at most twice what the longest row needs.
    With capture=False (CPU) the same fixed-shape step runs eagerly: the path the tests compare."""

    def __init__(self, model, pool: CachePool, max_rows: int, capture: bool):
        self.model, self.pool, self.capture = model, pool, capture
        self.max_rows = 1 << (max_rows - 1).bit_length()
        self.entries: dict[tuple[int, int], tuple[DecodeGraphView, object, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def _forward(self, view: DecodeGraphView) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled step builds its layout tensors in its own graph: reading
            view.forget_shared()           # those of the previous step would guard on them (a second compile)
        h = self.model.model(view.ids[None], cache=view)
        return self.model.lm_head(h[0])

    def run(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step of seqs (each feeding its next token, or ids [len(seqs)]
        on the device when given)."""
        rows = 1 << (len(seqs) - 1).bit_length()
        width = 1 << (max(len(s.block_table) for s in seqs) - 1).bit_length()
        return self._step((rows, width), seqs, ids)[:len(seqs)]

    def warm_up(self, max_blocks: int) -> int:
        """Make every (rows, width) graph for block tables up to max_blocks wide now, each from a step of pad rows
        only (the scratch slot and block: nothing real is read or written). Returns how many were new."""
        widths = [1 << w for w in range((max(1, max_blocks) - 1).bit_length() + 1)]
        keys = [(1 << r, w) for r in range(self.max_rows.bit_length()) for w in widths]
        new = [k for k in keys if k not in self.entries]
        for key in new:
            self._step(key, [])
        return len(new)

    def _step(self, key: tuple[int, int], seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        """The step of key's graph over seqs (padded to its rows), captured first if new → logits [rows, vocab]."""
        fresh = key not in self.entries
        if fresh:
            self.entries[key] = (DecodeGraphView(self.pool, self.model.config.num_hidden_layers, *key), None, None)
        view, graph, out = self.entries[key]
        view.load(seqs, ids)
        if graph is not None:
            graph.replay()
            return out
        if fresh and self.capture:
            return self._capture(key, view)
        return self._forward(view)

    def _capture(self, key: tuple[int, int], view: DecodeGraphView) -> torch.Tensor:
        """Run the loaded step eagerly on a side stream (it is also the warm-up capture needs: autotuning,
        cuBLAS workspaces), then capture it; capture only records, so the pool is written once. Returns the
        eager step's logits."""
        device = self.pool.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            logits = self._forward(view)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may touch CUDA while this one captures; a capture stream of
        # the pool's device (the graph's default capture stream belongs to whichever device first made it)
        with gc_paused(), torch.cuda.graph(graph, pool=self.mempool, stream=torch.cuda.Stream(device),
                                           capture_error_mode="thread_local"):
            out = self._forward(view)
        self.entries[key] = (view, graph, out)
        return logits

    def fits(self, seqs: list[Sequence], lens: list[int]) -> bool:
        """One token per sequence, none of them inside a prompt with images (image rows are spliced in eagerly)."""
        return len(seqs) <= self.max_rows and all(n == 1 for n in lens) and \
            not any(s.mm and s.in_prefill for s in seqs)


def kda_cores_take_graph_plans(model, device: torch.device) -> bool:
    """Whether every KDA layer's chunked core runs over a CUDA-graph chunk plan on `device` (k3.ops.kda_core.
    takes_graph_plan): what capturing the cores with the prefill graphs (StaticKDAView) needs."""
    dtype = model.model.embed_tokens.weight.dtype  # the features' dtype
    return all(takes_graph_plan(torch.empty(1, 1, m.num_heads, m.head_dim, dtype=dtype, device=device), m.lower_bound)
               for m in model.modules() if isinstance(m, KimiDeltaAttention))


class ModelRunner:
    def __init__(self, model, pool: CachePool, decode_graphs: bool | None = None, max_num_seqs: int = 64,
                 vocab: int | None = None, split_mixed: bool = False, prefill_graphs: bool | None = False,
                 max_batch_tokens: int = 8192, static_kda: bool | None = None):
        """decode_graphs: replay decode-only steps from CUDA graphs (default: on CUDA). On CPU, True runs the
        same fixed-shape decode step eagerly (for tests). vocab: the ids prompt logprobs range over (the
        engine's sampling vocabulary; default the model's). split_mixed: with graphs, a step that mixes decodes
        with prefill chunks replays the decodes' graph and runs only the chunks eagerly (see `_run`).
        prefill_graphs: the other steps (up to max_batch_tokens tokens) through piecewise CUDA graphs broken at
        the mixers' cores (k3.serve.prefill_graphs; None: on CUDA where the model allows; True on CPU runs the
        same pieces and breaks eagerly). static_kda: the prefill graphs' KDA cores over a fixed-shape layout per
        bucket (StaticKDAView), captured with the pieces instead of breaking them (None: on CUDA where every KDA
        core takes a graph plan)."""
        self.model, self.pool, self.split_mixed = model, pool, split_mixed
        self.vocab = vocab or model.config.vocab_size
        self.device = next(model.parameters()).device
        fuse_projections(model)  # each mixer's input projections as one GEMM (k3.ops.fused_linear)
        on_cuda = self.device.type == "cuda"
        use = wants_graphs(model, self.device, decode_graphs)
        self.graphs = DecodeGraphs(model, pool, max_num_seqs, capture=on_cuda) if use else None
        layers = model.config.num_hidden_layers
        if static_kda is None:
            static_kda = on_cuda and kda_cores_take_graph_plans(model, self.device)
        elif static_kda and on_cuda and not kda_cores_take_graph_plans(model, self.device):
            _log.warning("static KDA cores: this model's KDA core on %s does not run over a CUDA-graph chunk plan "
                         "(that needs fla's lean chunked core on a 16-bit model): its prefill graphs break at the "
                         "KDA cores instead", self.device)
            static_kda = False
        kda_view = (lambda tokens: StaticKDAView(pool, layers, tokens, max_num_seqs)) if static_kda else None
        self.prefill_graphs = (PrefillGraphs(model, max_batch_tokens, self.device, capture=on_cuda, kda_view=kda_view)
                               if wants_graphs(model, self.device, prefill_graphs) else None)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], lens: list[int], sample_rows: list[int],
            ids: torch.Tensor | None = None) -> tuple[torch.Tensor, PromptScores | None]:
        """Feed seqs[i].tokens[num_computed : num_computed + lens[i]] for every i; return the last-token
        logits [len(sample_rows), vocab] of the rows that will sample, and the prompt logprobs of the chunk's
        positions for sequences that ask for them (None when none does). Does not advance num_computed.
        ids: the input tokens of the step's decoding rows [rows], in step order, on the device (async output: the
        previous step's picks, not yet on the host); beside prompt chunks only where `takes_mixed_in_flight`."""
        with on_device(self.device):  # the engine's own thread starts on device 0
            if ids is None:
                return self._run(seqs, lens, sample_rows)
            decodes = [i for i, s in enumerate(seqs) if not s.in_prefill]
            if not decodes or len(decodes) != ids.shape[0] or any(lens[i] != 1 for i in decodes):
                raise ValueError(f"device input ids are one per decoding row (a step has one or more): "
                                 f"{ids.shape[0]} for {len(decodes)}")
            if len(decodes) < len(seqs):
                if not self.takes_mixed_in_flight:
                    raise ValueError("device input ids beside prompt chunks need the split decode graphs")
                return self._run_split(seqs, lens, sample_rows, decodes, self.scored_spans(seqs, lens), ids)
            if self.graphs is not None and self.graphs.fits(seqs, lens):
                logits = self.graphs.run(seqs, ids)
                return (logits if len(sample_rows) == len(seqs) else logits[sample_rows]), None
            return self._run_eager(seqs, lens, sample_rows, [], ids)

    @property
    def takes_mixed_in_flight(self) -> bool:
        """Whether a step may feed its decodes' ids from the device beside prompt chunks: the decodes then replay
        their graph (`_run_split`), which reads the ids on the device, and only the chunks need host tokens."""
        return self.graphs is not None and self.split_mixed

    @staticmethod
    def scored_spans(seqs: list[Sequence], lens: list[int]) -> list[tuple[int, int, int]]:
        """(index, first target position, count) per sequence scoring its prompt in this step: the chunk's
        positions p that predict a prompt token (p + 1 < prompt length)."""
        spans = []
        for i, (s, n) in enumerate(zip(seqs, lens)):
            if s.params.prompt_logprobs is not None and s.in_prefill:
                count = min(s.num_computed + n, s.prompt_len - 1) - s.num_computed
                if count > 0:
                    spans.append((i, s.num_computed + 1, count))
        return spans

    def _run(self, seqs: list[Sequence], lens: list[int],
             sample_rows: list[int]) -> tuple[torch.Tensor, PromptScores | None]:
        spans = self.scored_spans(seqs, lens)
        if not spans and self.graphs is not None and self.graphs.fits(seqs, lens):
            logits = self.graphs.run(seqs)
            return (logits if len(sample_rows) == len(seqs) else logits[sample_rows]), None
        decodes = self._graph_decodes(seqs, lens) if self.split_mixed and self.graphs is not None else []
        if decodes:
            return self._run_split(seqs, lens, sample_rows, decodes, spans)
        return self._run_eager(seqs, lens, sample_rows, spans)

    def _graph_decodes(self, seqs: list[Sequence], lens: list[int]) -> list[int]:
        """Indices of the decoding rows of a step that also feeds prompt chunks, when they can take their graph."""
        rows = [i for i, (s, n) in enumerate(zip(seqs, lens)) if n == 1 and not s.in_prefill]
        return rows if rows and len(rows) < len(seqs) and len(rows) <= self.graphs.max_rows else []

    def _run_split(self, seqs: list[Sequence], lens: list[int], sample_rows: list[int], decodes: list[int],
                   spans: list[tuple[int, int, int]], ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, PromptScores | None]:
        """A mixed step as two forwards: the decoding rows replay their graph, the prompt chunks run eagerly. An
        eager forward's host work grows with its rows (the profile of 64 streams on an H200: a 2,048-token step
        took 173 ms with 56 decodes in it, 118 ms without); the graph's replay costs the host almost nothing, and
        the two read and write disjoint slots and blocks. Logits come back in sample_rows order, prompt scores
        with the step's own row indices (only prompt chunks score). ids: the decodes' input tokens on the device."""
        dec, sampling = set(decodes), set(sample_rows)
        rest = [i for i in range(len(seqs)) if i not in dec]
        graph_logits = self.graphs.run([seqs[i] for i in decodes], ids)  # a static buffer: read before the next replay
        sampled_rest = [j for j, i in enumerate(rest) if i in sampling]
        where = {i: j for j, i in enumerate(rest)}
        chunk_logits, scores = self._run_eager([seqs[i] for i in rest], [lens[i] for i in rest], sampled_rest,
                                               [(where[i], first, count) for i, first, count in spans])
        if scores is not None:
            scores.spans = spans
        # where each sampling row's logits sit in cat(graph rows, sampled chunk rows)
        at = {i: k for k, i in enumerate(decodes)}
        at.update((rest[j], len(decodes) + k) for k, j in enumerate(sampled_rest))
        order = [at[i] for i in sample_rows]
        logits = torch.cat([graph_logits, chunk_logits])
        if order != list(range(len(order))) or len(order) != logits.shape[0]:
            order_t, = PagedBatchView.upload([order], self.device)
            logits = logits.index_select(0, order_t)
        return logits, scores

    def _run_eager(self, seqs: list[Sequence], lens: list[int], sample_rows: list[int],
                   spans: list[tuple[int, int, int]], device_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, PromptScores | None]:
        """One eager forward over every row of the step (the flat [1, N] row through the paged pool);
        device_ids: a decode-only step's input tokens, already on the device."""
        ids = ([] if device_ids is not None
               else [t for s, n in zip(seqs, lens) for t in s.tokens[s.num_computed:s.num_computed + n]])
        view = PagedBatchView(self.pool, self.model.config.num_hidden_layers, seqs, lens)
        last = [view.cu_host[r + 1] - 1 for r in sample_rows]  # each sampling row's last token
        scored = [view.cu_host[i] + j for i, _, count in spans for j in range(count)]
        targets = [t for i, first, count in spans for t in seqs[i].tokens[first:first + count]]
        pieces = self.prefill_graphs
        if (pieces is not None and device_ids is None and not any(s.mm for s in seqs)
                and pieces.fits(len(ids))):  # (image rows are spliced into the embeddings eagerly)
            last_t, scored_t, targets_t = view.upload([last, scored, targets], self.device)
            h = pieces.run(view, ids)  # [bucket, D]: the step's rows first
            scores = self._score(spans, seqs, h, scored_t, targets_t) if spans else None
            return self.model.lm_head(h[last_t]), scores
        ids_t, last_t, scored_t, targets_t = view.upload([ids, last, scored, targets], self.device)
        ids_t = (device_ids if device_ids is not None else ids_t)[None]
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
        scores = self._score(spans, seqs, h[0], scored_t, targets_t) if spans else None
        return self.model.lm_head(h[0, last_t]), scores

    def _score(self, spans, seqs, h: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> PromptScores:
        """Prompt logprobs of hidden rows h[rows] for their targets, SCORE_ROWS rows per lm_head call."""
        k = max(seqs[i].params.prompt_logprobs for i, _, _ in spans)
        parts = [score_rows(self.model.lm_head(h[rows[a:a + SCORE_ROWS]])[:, :self.vocab],
                            targets[a:a + SCORE_ROWS], k) for a in range(0, len(rows), SCORE_ROWS)]
        chosen, top_ids, top_lps = (torch.cat(x) for x in zip(*parts))
        return PromptScores(spans, targets, chosen, top_ids, top_lps)
