"""Piecewise CUDA graphs for the engine's eager steps (prefill chunks, and decodes beside them): the forward of a
step padded to a token bucket is captured as a chain of graphs broken at each mixer's core, the one part whose
launches depend on the step's sequences (fla's varlen chunked KDA over its `cu_seqlens`, the KDA state and conv
tail gathers by slot, MLA's paged context per prefill row). A replay runs graph 0, the first core eagerly with the
step's real layout, graph 1, ... so a 2,048-token step costs the host one graph launch per piece plus the cores'
own launches, instead of every projection, norm, AttnRes mix and expert GEMM of every layer (vLLM's piecewise
graphs, with its attention ops as the breaks; here the breaks are the mixers' layout hooks, `PiecewiseLayout`).

Padding: the step's N tokens sit in the first N rows of the bucket's static ids; the pad rows embed token 0 and
flow through the per-token parts (norms, mixes, MLP, experts), while every core runs on the first N rows only and
leaves zeros in the pad rows of its output. Nothing a real row computes reads a pad row.
With a fixed-shape KDA layout per bucket (`static_kda_cores`, k3.serve.runner.StaticKDAView: the step's rows, a pad
document over the pad rows and empty documents up to a fixed count, fla's chunk plan padded likewise, all refilled
in place before each replay) the KDA cores need no break: only MLA's cores split the chain (4 breaks for `small`'s
16 layers instead of 16).
On a CPU (or where graphs are off) the same pieces and breaks run eagerly in one pass: the path tests compare.
fp32 models with routed experts capture the expert GEMMs through per-row weights (k3.ops.grouped_mm.rows_linear,
memory rows × expert size): serve bf16, where `_grouped_mm` captures as it is."""
from __future__ import annotations

import contextlib
import functools
import gc
import logging

import torch

from k3.model import kda as kda_mixer, mla as mla_mixer
from k3.model.cache import BatchCacheView
from k3.serve.staging import PinnedStaging

_log = logging.getLogger(__name__)

# Smallest bucket: below it the step's host work is small anyway, and every bucket is one more capture.
MIN_BUCKET_TOKENS = 16
# Buckets double up to here, then grow by about a quarter (in multiples of 256 tokens): a big step pads at most ~25%
# (under load, steps of ~1,100 tokens were common; a 2,048 bucket ran their per-token parts at almost twice the work).
DOUBLING_UNTIL = 1024


def token_buckets(max_tokens: int) -> list[int]:
    """The padded token counts steps of up to max_tokens tokens use: powers of two from MIN_BUCKET_TOKENS to
    DOUBLING_UNTIL, then steps of a quarter rounded down to 256 tokens, the last one max_tokens itself (a full
    step, the common one under load, pads nothing)."""
    out, b = [], MIN_BUCKET_TOKENS
    while b < max_tokens:
        out.append(b)
        b = 2 * b if b < DOUBLING_UNTIL else b + max(256, b // 4 // 256 * 256)
    return out + [max_tokens]


@contextlib.contextmanager
def gc_paused():
    """No garbage collection inside: a CUDA graph captured while Python's collector frees another one (an old
    engine's, say) is invalidated, since destroying a graph is not allowed while a stream captures."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PiecewiseLayout:
    """The `cache` a piecewise forward hands the model: KDA's and MLA's layout hooks (see k3.model.kda.kda_layout
    and k3.model.mla.mla_layout), each core a break of `graph`. KDA's short convs read the pool's tails by slot,
    so they run inside the core's break: `short_convs` returns its inputs unchanged and `core` convolves them."""

    def __init__(self, graph: "PrefillGraph"):
        self.graph = graph
        self.view: BatchCacheView | None = None  # the running step's view, set before each forward or replay

    # ---- KDA --------------------------------------------------------------------------------------------
    def decode_slots(self, m, T: int):
        return None  # never the fused one-kernel decode step: its slots are the step's, not the graph's

    def short_convs(self, m, xs: list[torch.Tensor]):
        if self.graph.kda_view is not None:  # the bucket's fixed-shape layout: convolved here, inside the piece
            return kda_mixer.VarlenLayout(self.graph.kda_view).short_convs(m, xs)
        return xs, (None, None, None)  # convolved in `core`'s break, which knows the step's sequences

    def core(self, m, q, k, v, f, beta_logits, tails) -> torch.Tensor:
        if self.graph.kda_view is not None:  # no break: the core over the padded layout is part of the piece
            return kda_mixer.VarlenLayout(self.graph.kda_view).core(m, q, k, v, f, beta_logits, tails)
        return self.graph.split(functools.partial(self._kda_core, m), (q, k, v, f, beta_logits), v.shape, v.dtype)

    def _kda_core(self, m, q, k, v, f, beta_logits, out: torch.Tensor) -> None:
        """The step's short convs and KDA core over its first n rows (q, k, v not yet convolved)."""
        n, layout = self.view.cu_host[-1], kda_mixer.VarlenLayout(self.view)
        H, K = m.num_heads, m.head_dim
        convs, tails = layout.short_convs(m, [t[:, :n].reshape(1, n, H * K) for t in (q, k, v)])
        q, k, v = (c.view(1, n, H, K) for c in convs)
        out[:, :n] = layout.core(m, q, k, v, f[:, :n], beta_logits[:, :n], tails)

    # ---- MLA --------------------------------------------------------------------------------------------
    def attend(self, m, q, latent, k_extra) -> torch.Tensor:
        return self.graph.split(functools.partial(self._mla_attend, m), (q, latent, k_extra),
                                (*q.shape[:3], m.v_dim), q.dtype)

    def _mla_attend(self, m, q, latent, k_extra, out: torch.Tensor) -> None:
        """The step's latent writes and attention over its first n rows."""
        n = self.view.cu_host[-1]
        out[:, :n] = mla_mixer.VarlenLayout(self.view).attend(m, q[:, :n], latent[:, :n], k_extra[:, :n])


class PrefillGraph:
    """One token bucket: static ids [tokens], the final hidden states [tokens, D] and, once captured, the pieces
    (CUDA graphs) with the breaks between them (each a core: its function, input tensors and output buffer)."""

    def __init__(self, model, tokens: int, device: torch.device, kda_view=None):
        self.model, self.tokens, self.device = model, tokens, device
        self.kda_view = kda_view  # the KDA layers' fixed-shape layout (k3.serve.runner.StaticKDAView), or None
        self.layout = PiecewiseLayout(self)
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.staging = PinnedStaging(self.ids)
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[tuple] = []
        self.hidden: torch.Tensor | None = None
        self.capturing, self.mempool = False, None

    def load(self, ids: list[int]) -> None:
        """The step's token ids into the first rows, zeros after them: one copy from pinned memory."""
        values = torch.zeros(self.tokens, dtype=torch.long)
        values[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.staging.load(values)

    def split(self, core, inputs: tuple, shape, dtype) -> torch.Tensor:
        """A break at a mixer's core: its output buffer (zeros: the pad rows stay zero), filled by `core` now
        (eager pass) or at each replay (capture: this piece ends here, the next begins after the core)."""
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        if not self.capturing:
            core(*inputs, out)
            return out
        self.pieces[-1].capture_end()
        self.breaks.append((core, inputs, out))
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(self.mempool, capture_error_mode="thread_local")
        return out

    def forward(self) -> torch.Tensor:
        return self.model.model(self.ids[None], cache=self.layout)[0]

    def capture(self, mempool) -> None:
        """Record the pieces of the loaded shape (nothing runs: the cores are skipped, the pool is not written).
        The caller has run the same bucket eagerly first (autotuning and workspaces happen outside capture)."""
        device, self.mempool = self.device, mempool
        if self.kda_view is not None:  # what the eager pass derived from the layout (the conv's gather indices) is
            self.kda_view.forget_shared()  # derived again inside: a replay must recompute it from the refilled layout
        torch.cuda.synchronize(device)  # as torch.cuda.graph does: nothing queued while the allocator turns to the pool
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        self.pieces, self.breaks, self.capturing = [torch.cuda.CUDAGraph()], [], True
        try:
            # thread_local: the server's other threads may touch CUDA while this one captures
            with torch.cuda.stream(stream), gc_paused():
                self.pieces[0].capture_begin(mempool, capture_error_mode="thread_local")
                try:
                    self.hidden = self.forward()
                except BaseException:
                    with contextlib.suppress(Exception):  # close the stream's capture; the caller takes a new pool
                        self.pieces[-1].capture_end()
                    raise  # the forward's own error, not capture_end's "failed due to a previous error"
                self.pieces[-1].capture_end()
        except BaseException:
            self.pieces, self.breaks, self.hidden = [], [], None
            raise
        finally:
            self.capturing = False
        torch.cuda.current_stream(device).wait_stream(stream)

    def replay(self) -> torch.Tensor:
        for piece, brk in zip(self.pieces, self.breaks + [None]):
            piece.replay()
            if brk is not None:
                core, inputs, out = brk
                core(*inputs, out)
        return self.hidden


class PrefillGraphs:
    """The engine's eager steps through piecewise graphs, one `PrefillGraph` per token bucket, captured on first
    use after an eager pass of that step (capture=False: every step is that eager pass, pieces and breaks alike;
    a bucket whose capture fails stays eager, with one warning).
    All buckets share one memory pool of their own (one step replays at a time; the decode graphs keep theirs,
    whose logits a split step still reads after this replay)."""

    def __init__(self, model, max_tokens: int, device: torch.device, capture: bool, kda_view=None):
        """kda_view: None (the KDA cores break the chain) or a factory of a bucket's fixed-shape KDA layout
        (tokens → k3.serve.runner.StaticKDAView): its cores are then captured with the rest, and only MLA's break."""
        self.model, self.device, self.capture, self.kda_view = model, device, capture, kda_view
        self.buckets = token_buckets(max_tokens)
        self.entries: dict[int, PrefillGraph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def run(self, view: BatchCacheView, ids: list[int]) -> torch.Tensor:
        """Hidden states [bucket, D] of the step whose layout is `view` and whose tokens are `ids` (its first
        len(ids) rows are the step's; the buffer is static: read it before the next step of this bucket)."""
        tokens = next(b for b in self.buckets if b >= len(ids))
        graph = self.entries.get(tokens)
        fresh = graph is None
        if fresh:
            graph = self.entries[tokens] = PrefillGraph(self.model, tokens, self.device,
                                                        self.kda_view(tokens) if self.kda_view else None)
        graph.layout.view = view
        graph.load(ids)
        if graph.kda_view is not None:
            cu = view.cu_host
            graph.kda_view.load([b - a for a, b in zip(cu, cu[1:])], view.slots_host)
        try:
            if graph.pieces:
                return graph.replay()
            if not (fresh and self.capture):
                return graph.forward()
            # the eager pass on a side stream (as DecodeGraphs: also the warm-up the capture needs), then capture
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                hidden = graph.forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            try:
                graph.capture(self.mempool)
            except Exception as e:  # the step has run; this bucket stays eager rather than fail the engine
                # a fresh pool: capture_end can fail before the allocator stops routing to this one, and the next
                # capture_begin on it would refuse ("already recording to mempool_id")
                self.mempool = torch.cuda.graph_pool_handle()
                _log.warning("prefill graphs: the %d-token bucket could not be captured (%s: %s); its steps run "
                             "eagerly", tokens, type(e).__name__, e)
            return hidden
        finally:
            graph.layout.view = None  # the view holds the step's device tensors: not kept past the step
