"""Per-sequence decode state, passed in and out of the model explicitly (never hidden in modules).

Three caches share one small interface that the mixers call (`kda_state`, `set_kda_state`, `mla_append`,
`advance`): `K3Cache` grows as it goes, `StaticCache` is preallocated and written in place (so a decode step can
be captured in a CUDA graph), and `BatchCacheView` maps sequences of different lengths onto the serving pool.
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from itertools import chain

import torch

from k3.ops.varlen_attention import VarlenSegments

_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f"}  # array.array's, for BatchCacheView.upload


def kda_local_heads(config, tp: int = 1) -> int:
    """KDA heads one rank holds under tensor parallelism of size tp (k3.parallel.tensor_parallel): its state
    [.., H/tp, K, V] and conv tails hold those heads only."""
    heads = config.linear_attn_config.num_heads
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or heads % tp:
        raise ValueError(f"tensor parallel size {tp!r} must be an integer >= 1 dividing the {heads} KDA heads")
    return heads // tp


@dataclass
class KDAState:
    """One KDA layer: recurrent state [B, H, K, V] (fp32) and the last W−1 inputs of the q, k, v convs."""
    state: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor


@dataclass
class KDASlots:
    """Where a decode step finds one KDA layer's state and conv tails and writes them back in place: state
    [N, H, K, V] fp32, tails [N, W−1, C] fp32 (strided views allowed), and `slots` [B] (int64, on the device),
    the slot of each decoding row, or None when row b is slot b (k3.ops.kda_decode)."""
    state: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    slots: torch.Tensor | None = None


@dataclass
class MLAState:
    """One MLA layer, absorbed form: normalised latent [B, S, kv_lora_rank] and shared k_extra [B, S, rope]."""
    latent: torch.Tensor
    k_extra: torch.Tensor


@dataclass
class K3Cache:
    """Decode state of a batch of sequences of equal length `seq_len`: one entry per layer (None until filled)."""
    num_layers: int
    seq_len: int = 0
    layers: list = field(default_factory=list)

    def __post_init__(self):
        if not self.layers:
            self.layers = [None] * self.num_layers

    def kda_state(self, layer_idx: int) -> KDAState | None:
        return self.layers[layer_idx]

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        self.layers[layer_idx] = state

    def kda_slots(self, layer_idx: int) -> KDASlots | None:
        """The layer's KDA storage for a decode step that writes it in place; None: this cache's tensors are
        replaced, not written (the step returns new ones through `set_kda_state`)."""
        return None

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor):
        """Append T new tokens' latent [B, T, R] and k_extra [B, T, rope]; return the whole context
        (latent [B, S, R], k_extra [B, S, rope], kv_len) where kv_len [B] is None when every row is full."""
        st = self.layers[layer_idx]
        if st is None:
            st = self.layers[layer_idx] = MLAState(latent, k_extra)
        else:
            st.latent = torch.cat([st.latent, latent], dim=1)
            st.k_extra = torch.cat([st.k_extra, k_extra], dim=1)
        return st.latent, st.k_extra, None

    def advance(self, n: int) -> None:
        self.seq_len += n

    def nbytes(self) -> int:
        total = 0
        for s in self.layers:
            if s is not None:
                total += sum(t.numel() * t.element_size() for t in vars(s).values())
        return total


class StaticCache(K3Cache):
    """K3Cache with every buffer allocated up front for `max_len` tokens and written in place.

    Shapes never change and the length also lives on the device (`length`, advanced by the forward itself),
    so one decode step can be captured in a CUDA graph and replayed (k3.model.cuda_graph). MLA layers attend
    over all `max_len` slots with a length mask. `seq_len` is the host's copy of the length.
    """

    def __init__(self, config, batch: int, max_len: int, device=None, dtype: torch.dtype = torch.float32,
                 tp: int = 1):
        super().__init__(config.num_hidden_layers)
        la = config.linear_attn_config
        H, K, W = kda_local_heads(config, tp), la.head_dim, la.short_conv_kernel_size
        self.batch, self.max_len = batch, max_len
        self.length = torch.zeros((), dtype=torch.long, device=device)
        sd = torch.float64 if dtype == torch.float64 else torch.float32  # KDA state and conv tails: fp32 or wider
        tail = lambda: torch.zeros(batch, W - 1, H * K, dtype=sd, device=device)  # noqa: E731
        for l in range(self.num_layers):
            if config.is_mla(l):
                self.layers[l] = MLAState(
                    torch.zeros(batch, max_len, config.kv_lora_rank, dtype=dtype, device=device),
                    torch.zeros(batch, max_len, config.qk_rope_head_dim, dtype=dtype, device=device))
            else:
                self.layers[l] = KDAState(torch.zeros(batch, H, K, K, dtype=sd, device=device),
                                          tail(), tail(), tail())

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        dst = self.layers[layer_idx]
        for name in ("state", "conv_q", "conv_k", "conv_v"):
            if getattr(state, name) is not getattr(dst, name):  # a decode step may have written it in place
                getattr(dst, name).copy_(getattr(state, name))

    def kda_slots(self, layer_idx: int) -> KDASlots:
        st = self.layers[layer_idx]
        return KDASlots(st.state, st.conv_q, st.conv_k, st.conv_v)

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor):
        T = latent.shape[1]
        # (not in a compiled step: the host length would be a guard, so every step would compile anew; a
        # compiled step's caller checks the room itself, as GraphedDecodeStep.step does)
        if not torch.compiler.is_compiling() and self.seq_len + T > self.max_len:
            raise ValueError(f"StaticCache holds {self.max_len} tokens; {self.seq_len} cached + {T} new do not fit")
        st = self.layers[layer_idx]
        pos = self.length + torch.arange(T, device=latent.device)
        st.latent.index_copy_(1, pos, latent.to(st.latent.dtype))
        st.k_extra.index_copy_(1, pos, k_extra.to(st.k_extra.dtype))
        return st.latent, st.k_extra, (self.length + T).expand(self.batch)

    def advance(self, n: int) -> None:
        self.seq_len += n
        self.length += n  # in place: a captured graph replays the increment

    def kda_snapshot(self) -> list:
        """Copies of the KDA buffers and both lengths (MLA slots past the length need no saving)."""
        return [self.seq_len, self.length.clone()] + [
            None if isinstance(s, MLAState) else KDAState(*(t.clone() for t in vars(s).values())) for s in self.layers]

    def restore(self, snap: list) -> None:
        self.seq_len = snap[0]
        self.length.copy_(snap[1])
        for l, s in enumerate(snap[2:]):
            if s is not None:
                self.set_kda_state(l, s)


class BatchCacheView:
    """Decode state of S sequences of different lengths whose new tokens are flattened into one row [1, N].

    The storage lives elsewhere (k3.serve's paged pool and state slab); the mixers only call these hooks.
    A sequence with `T_s` new tokens and `kv_len_s` tokens of context after this step holds its new tokens at
    positions kv_len_s − T_s … kv_len_s − 1.

    The step's layout is known on the host when the view is built (`set_layout`), so the mixers never read a
    device value back (each read waits for every kernel queued so far and stops the host running ahead).
    Sequences split into decodes (T_s = 1: one recurrent step, batched absorbed attention) and prefill chunks
    (T_s > 1: chunked KDA, one packed varlen attention). Layout attributes, host lists for shapes and loops, device
    tensors (built once per step) for gathers:
    - `kv_lens` [S] kv_len_s; `cu_host` [S+1] each sequence's slice of the flat row; `kv_len`, `cu_seqlens`:
      the same on the device.
    - `decode_rows`, `decode_rows_t`: the decoding sequences; `decode_tokens_t`: their tokens' flat positions;
      `decode_max_len`: their longest kv_len (0 when none).
    - `prefill_rows`, `prefill_rows_t`: the others, in order; `prefill_tokens_t`: their tokens' flat positions,
      in order; `prefill_cu_seqlens`: offsets [P+1] of each chunk within those tokens, and
      `prefill_cu_seqlens_cpu` the same on the host: fla plans its chunks from it instead of reading the device
      copy back, and it is one object for the whole step, so fla's per-tensor cache plans once, not per layer;
      `prefill_span`: (rows, tokens) as two slices when the prefill rows are consecutive (their tokens are then
      one run), else None; `prefill_segments`: the prefill rows' new tokens over their whole contexts as packed
      segments (k3.ops.varlen_attention), None when there are none.
    `shared` keeps what layers derive from the layout alike (built by the first, reused by the rest);
    `upload` sends host lists to the device without waiting for queued work.
    """
    num_layers: int
    seq_len: int = 0  # unused (sequences differ); kept so the model's bookkeeping works unchanged
    prefill_plan = None  # fla's chunk plan of the prefill rows when the view makes its own (a CUDA-graph layout's)

    def set_layout(self, lens: list[int], kv_lens: list[int], device) -> None:
        """Fill the layout attributes from the host lengths (every T_s >= 1), with one copy to `device`."""
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        decode = [r for r, n in enumerate(lens) if n == 1]
        prefill = [r for r, n in enumerate(lens) if n > 1]
        prefill_cu = [0]
        for r in prefill:
            prefill_cu.append(prefill_cu[-1] + lens[r])
        self.kv_lens, self.cu_host = list(kv_lens), cu
        self.decode_rows, self.prefill_rows = decode, prefill
        self.decode_max_len = max((kv_lens[r] for r in decode), default=0)
        # consecutive prefill rows hold one run of tokens: slices (views) then replace the gathers
        self.prefill_span = ((slice(prefill[0], prefill[-1] + 1), slice(cu[prefill[0]], cu[prefill[-1] + 1]))
                             if prefill and prefill[-1] - prefill[0] == len(prefill) - 1 else None)
        # the prefill tokens' positions (one per token) go up only where no span replaces them
        tokens = [] if self.prefill_span is not None else list(chain.from_iterable(
            range(cu[r], cu[r + 1]) for r in prefill))
        (self.cu_seqlens, self.kv_len, self.decode_rows_t, self.decode_tokens_t, self.prefill_rows_t,
         prefill_tokens_t, self.prefill_cu_seqlens) = self.upload(
            [cu, kv_lens, decode, [cu[r] for r in decode], prefill, tokens, prefill_cu], device)
        self._prefill_tokens_t = prefill_tokens_t if self.prefill_span is None else None
        self.prefill_cu_seqlens_cpu = torch.tensor(prefill_cu, dtype=torch.long)
        kv_cu = [0]  # the prefill rows' whole contexts packed (MLA's keys), with their new tokens as the queries
        for r in prefill:
            kv_cu.append(kv_cu[-1] + kv_lens[r])
        self.prefill_segments = VarlenSegments.build(prefill_cu, kv_cu, device) if prefill else None
        self.forget_shared()

    @property
    def prefill_tokens_t(self) -> torch.Tensor:
        """The prefill tokens' flat positions on the device; built on first use where `prefill_span` covers them
        (the layouts then take the span's slice instead)."""
        if self._prefill_tokens_t is None:
            span = self.prefill_span[1] if self.prefill_span is not None else slice(0, 0)
            self._prefill_tokens_t = self.send(torch.arange(span.start, span.stop), self.cu_seqlens.device)
        return self._prefill_tokens_t

    @staticmethod
    def upload(lists: list[list], device, dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
        """Tensors of `dtype` (int64 by default) on `device` holding the given host lists, sent in one copy. On
        CUDA it leaves from pinned memory without blocking: a plain copy from pageable memory waits for every
        queued kernel."""
        # an eager step's lists hold a value per token (8,192 at full steps) and per context position: chain
        # flattens at C speed and array.array packs ~3x faster than torch.tensor(list) (130 us for 2,048 ints)
        buf = array.array(_TYPECODES[dtype], chain.from_iterable(lists))
        flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        if torch.device(device).type == "cuda":
            flat = flat.pin_memory()
        return list(flat.to(device, non_blocking=True).split([len(xs) for xs in lists]))

    @staticmethod
    def send(host: torch.Tensor, device) -> torch.Tensor:
        """A host tensor on `device`, without waiting for queued kernels (from pinned memory on CUDA, as `upload`)."""
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)

    def shared(self, key, build):
        """`build()` once per step: tensors derived from the layout alone, which every layer needs alike."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def forget_shared(self) -> None:
        """Drop what `shared` kept: the next reader builds it anew."""
        self._shared = {}

    def kda_state(self, layer_idx: int) -> KDAState:
        """state [S, H, K, V] fp32 and conv tails [S, W−1, C] (zeros for fresh sequences)."""
        raise NotImplementedError

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        raise NotImplementedError

    def kda_slots(self, layer_idx: int) -> KDASlots | None:
        """The pool's state and tails of the layer with each sequence's slot, for a step in which every
        sequence decodes one token; None where the storage is not slot-addressed."""
        return None

    def mla_append(self, layer_idx: int, latent: torch.Tensor, k_extra: torch.Tensor) -> None:
        """Store the new tokens' latent [N, R] and k_extra [N, rope]."""
        raise NotImplementedError

    def mla_context(self, layer_idx: int, rows: torch.Tensor,
                    max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole context of the sequences `rows` [n] (device indices, e.g. `decode_rows_t`, or a slice of the
        step's rows) whose longest kv_len is `max_len` (from `kv_lens`): latent [n, max_len, R] and
        k_extra [n, max_len, rope] (padded past each row's kv_len), and kv_len [n]; this step's tokens included."""
        raise NotImplementedError

    def mla_paged(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The same context left in place for a kernel that walks block tables: the pool [num_blocks,
        block_size, R + rope] (latent then k_extra), block tables [n, width] and kv_len [n] of `rows`; None
        when the storage is not paged (the caller then uses `mla_context`)."""
        return None

    def mla_prefill_context(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prefill row's whole context (this step's tokens included), packed row after row without padding:
        latent [C, R] and k_extra [C, rope], C = Σ kv_lens over `prefill_rows`. Here from `mla_context` a row at a
        time; storage that can gather them all at once overrides it."""
        rows = [self.mla_context(layer_idx, slice(r, r + 1), self.kv_lens[r])[:2] for r in self.prefill_rows]
        return torch.cat([lat[0] for lat, _ in rows]), torch.cat([kx[0] for _, kx in rows])

    def advance(self, n: int) -> None:
        self.seq_len += n
