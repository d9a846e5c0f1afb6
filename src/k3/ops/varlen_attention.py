"""Causal attention of several sequences' new tokens over their own contexts, packed into one row each.

Segment s holds queries q[cu_q[s]:cu_q[s+1]] and keys k[cu_k[s]:cu_k[s+1]] with at least as many keys as queries:
its queries are the last positions of its keys (bottom-right causal: a prefill chunk after its cached context),
and no query sees another segment's keys. The serving engine's MLA prefill rows of a step run through here as one
call instead of one SDPA per row, and so do packed documents in training (`packed_documents`: each document of a
row a segment, where a [B, T, T] mask would make SDPA leave FlashAttention, compute every block across documents
and hold the mask, O(T²), through backward; context parallelism's shards likewise). Backends, by what the call
allows:
- CUDA, fp16/bf16, head dim <= 256: FlashAttention's varlen kernel (`torch.nn.attention.varlen.varlen_attn`; cuDNN's
  ragged SDPA was 20-40x slower in session 47, its dq wrong on one layout, and crashed at 32K: not a backend);
- small steps elsewhere (the CPU, fp32): one SDPA over the packed rows with a block-diagonal causal mask;
- larger ones: one SDPA per segment (`k3.ops.attention.causal_attention`), the plain reference.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F

from k3.ops.attention import causal_attention

# the masked SDPA materialises a [H, Nq, Nk] score block on its math path: past this many scores, one call a segment
MASKED_SDPA_MAX_SCORES = 1 << 25
FLASH_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class VarlenSegments:
    """The packing of a call: offsets on the host (`cu_q_host`, `cu_k_host`, lists of S+1) and the same on the
    device as int32 (`cu_q`, `cu_k`, what flash reads). Built once a step and shared by its layers."""
    cu_q_host: list[int]
    cu_k_host: list[int]
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q_host, self.cu_q_host[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k_host, self.cu_k_host[1:]))

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[Nq, Nk] bool: query i sees key j iff they are in one segment and j's position <= i's. Built on the
        device from the offsets there (sizes from the host lists: nothing is read back)."""
        cu_q, cu_k = self.cu_q.long(), self.cu_k.long()
        Nq, Nk, S = self.cu_q_host[-1], self.cu_k_host[-1], len(self.cu_q_host) - 1
        seg = torch.arange(S, device=cu_q.device)
        q_seg = torch.repeat_interleave(seg, cu_q.diff(), output_size=Nq)
        k_seg = torch.repeat_interleave(seg, cu_k.diff(), output_size=Nk)
        # a query's position among its segment's keys: the segment's key count less the queries still to come
        q_pos = cu_k.diff()[q_seg] - (cu_q[1:][q_seg] - torch.arange(Nq, device=cu_q.device))
        k_pos = torch.arange(Nk, device=cu_k.device) - cu_k[:-1][k_seg]
        return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] < q_pos[:, None] + 1)

    @staticmethod
    def build(cu_q_host: list[int], cu_k_host: list[int], device) -> "VarlenSegments":
        if len(cu_q_host) != len(cu_k_host) or len(cu_q_host) < 2:
            raise ValueError(f"need S+1 >= 2 offsets for both, got {len(cu_q_host)} and {len(cu_k_host)}")
        if any(kb - ka < qb - qa or qb - qa < 1 for qa, qb, ka, kb in
               zip(cu_q_host, cu_q_host[1:], cu_k_host, cu_k_host[1:])):
            raise ValueError(f"every segment needs >= 1 query and >= as many keys: q {cu_q_host}, k {cu_k_host}")
        pinned = torch.device(device).type == "cuda"
        flat = torch.tensor(cu_q_host + cu_k_host, dtype=torch.int32, pin_memory=pinned)
        cu_q, cu_k = flat.to(device, non_blocking=True).split(len(cu_q_host))
        return VarlenSegments(list(cu_q_host), list(cu_k_host), cu_q, cu_k)


@functools.lru_cache(maxsize=None)
def _flash_varlen():
    """torch's varlen_attn with causal masking set (torch 2.10 spells it is_causal, later ones window_size), or
    None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = functools.partial(varlen_attn, window_size=(-1, 0)) if "window_size" in params else \
        functools.partial(varlen_attn, is_causal=True)
    if "scale" in params:
        return causal

    def scaled(q, k, v, *args, scale):  # an entry without `scale` applies D^-0.5: q carries the rest of it
        return causal(q * (scale * q.shape[-1] ** 0.5), k, v, *args)
    return scaled


def flash_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == k.shape[-1]
            and max(q.shape[-1], v.shape[-1]) <= FLASH_MAX_HEAD_DIM and _flash_varlen() is not None)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                            scale: float, backend: str | None = None) -> torch.Tensor:
    """q: [Nq, H, D]; k: [Nk, H, D]; v: [Nk, H, V], packed as `segments` says. Returns [Nq, H, V] in v's dtype.
    `backend` ("flash", "masked", "loop") forces one (tests); None picks as the module docstring says."""
    if backend is None:
        Nq, H, _ = q.shape
        if flash_usable(q, k, v):
            backend = "flash"
        elif H * Nq * k.shape[0] <= MASKED_SDPA_MAX_SCORES:
            backend = "masked"
        else:
            backend = "loop"
    if backend == "flash":
        V = v.shape[-1]
        if V < q.shape[-1]:  # flash wants one head dim: zero columns of v leave the real ones unchanged
            v = F.pad(v, (0, q.shape[-1] - V))
        o = _flash_varlen()(q, k, v, segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, scale=scale)
        return o[..., :V]
    if backend == "masked":
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                           attn_mask=segments.mask, scale=scale)
        return o[0].transpose(0, 1)
    if backend != "loop":
        raise ValueError(f"backend must be one of 'flash', 'masked', 'loop' or None, got {backend!r}")
    out = []
    for qa, qb, ka, kb in zip(segments.cu_q_host, segments.cu_q_host[1:], segments.cu_k_host, segments.cu_k_host[1:]):
        out.append(causal_attention(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], scale)[0])
    return torch.cat(out)


@dataclasses.dataclass(frozen=True)
class DocumentPacking:
    """Rows [B, S] of packed documents as varlen segments, for the queries at positions [q_start, q_start + T) of
    every row (all of it in training; a context-parallel shard's). A segment is one document's queries over its
    keys up to its last query; a row's keys are those from the start of its first query's document to its last
    query (`key_spans`), so every segment has a query and no key is read that no query sees."""
    segments: VarlenSegments
    key_spans: tuple[tuple[int, int], ...]
    queries: int  # T

    @property
    def whole_rows(self) -> bool:
        """Each row one document from its first key: plain causal attention over the rows is the same, and
        faster than the varlen kernel (an H100, 8 x 4096, MLA's widths, forward and backward: 6.6 against 8.8 ms;
        `bench_gpu_kernels.py --doc-attention`, session 30)."""
        return len(self.segments.cu_q_host) - 1 == len(self.key_spans) and all(a == 0 for a, _ in self.key_spans)

    def pack_keys(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, ...] → [Nk, ...]: each row's key span, the rows one after another."""
        if all(span == (0, x.shape[1]) for span in self.key_spans):
            return x.reshape(-1, *x.shape[2:])
        return torch.cat([x[b, a:e] for b, (a, e) in enumerate(self.key_spans)])


def packed_documents(doc_ids: torch.Tensor, device, q_start: int = 0, queries: int | None = None) -> DocumentPacking:
    """The `DocumentPacking` of doc_ids [B, S] (positions of one document equal and adjacent within a row:
    k3.data.packing's), for the `queries` positions from q_start (default: the whole row). Reads doc_ids back to
    the host once (a device sync) and keeps the result on the tensor, so the layers of one forward share it."""
    S = doc_ids.shape[1]
    T = S - q_start if queries is None else queries
    if not (0 <= q_start and T >= 1 and q_start + T <= S):
        raise ValueError(f"queries [{q_start}, {q_start + T}) must be a non-empty part of the {S} positions")
    if doc_ids.is_inference():  # (no version counter to tell an in-place change by: made again each call)
        return _pack(doc_ids.detach().cpu(), device, q_start, T)
    key = (q_start, T, str(device), doc_ids._version)
    kept = getattr(doc_ids, "_k3_packings", None)
    if kept is None:
        kept = doc_ids._k3_packings = {}
    if key not in kept:
        kept.clear()  # (another shape or a changed tensor: the old entries are dead)
        kept[key] = _pack(doc_ids.detach().cpu(), device, q_start, T)
    return kept[key]


def _pack(ids: torch.Tensor, device, q_start: int, T: int) -> DocumentPacking:
    B, S = ids.shape
    q_end = q_start + T
    starts = torch.ones(B, S, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    cu_q, cu_k, spans = [0], [0], []
    for b in range(B):
        bounds = starts[b].nonzero().flatten().tolist() + [S]  # document i is [bounds[i], bounds[i+1])
        first = bisect.bisect_right(bounds, q_start) - 1  # the document of the first query
        spans.append((bounds[first], q_end))
        for ds, de in zip(bounds[first:], bounds[first + 1:]):
            if ds >= q_end:
                break
            cu_q.append(cu_q[-1] + min(de, q_end) - max(ds, q_start))
            cu_k.append(cu_k[-1] + min(de, q_end) - ds)
    return DocumentPacking(VarlenSegments.build(cu_q, cu_k, device), tuple(spans), T)


def packs_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether packed documents take `document_attention` over the masked SDPA: where FlashAttention's varlen
    kernel runs (elsewhere the masked SDPA is the plain path), outside torch.compile (the packing reads the host)."""
    return not torch.compiler.is_compiling() and flash_usable(q, k, v)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, packing: DocumentPacking,
                       backend: str | None = None) -> torch.Tensor:
    """Causal attention within documents: q [B, T, H, D] (the packing's queries), k [Nk, H, D] and v [Nk, H, V]
    packed by `packing.pack_keys`. Returns [B, T, H, V]; `backend` as `varlen_causal_attention`'s."""
    B, T = q.shape[:2]
    if T != packing.queries or B * T != packing.segments.cu_q_host[-1]:
        raise ValueError(f"q holds {B} x {T} queries; the packing was made for {packing.segments.cu_q_host[-1]}")
    o = varlen_causal_attention(q.reshape(B * T, *q.shape[2:]), k, v, packing.segments, scale, backend)
    return o.view(B, T, *o.shape[1:])
