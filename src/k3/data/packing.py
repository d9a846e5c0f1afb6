"""Pack tokenised documents into fixed-length training rows, never predicting across a document boundary.

Each document becomes [bos] + ids + [eos]. Epoch e lays the documents out in the order
`default_rng(seed + e).permutation(n_docs)`; the epochs follow one another as one endless token stream.
Row r holds stream[r*T : r*T + T + 1] (stride T, so consecutive rows share one token and every stream
token is an input exactly once): inputs are its first T tokens, labels its last T, with -100 wherever
the next token starts another document. The loader's whole position is the index of the next row.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def _check_common(token_docs: Sequence[Sequence[int]], seq_len: int, batch_size: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if len(token_docs) == 0:
        raise ValueError("token_docs must hold at least one document")


def _framed_stream(token_docs: Sequence[Sequence[int]], order: Sequence[int], bos_id: int,
                   eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate [bos] + doc + [eos] in `order`. Returns (tokens [L], slot [L]): slot = rank in `order`."""
    pieces, slots = [], []
    for slot, index in enumerate(order):
        doc = np.asarray(token_docs[index], dtype=np.int64)
        pieces.append(np.concatenate(([bos_id], doc, [eos_id])).astype(np.int64))
        slots.append(np.full(len(doc) + 2, slot, dtype=np.int64))
    return np.concatenate(pieces), np.concatenate(slots)


def _rows_to_batch(tokens: np.ndarray, doc: np.ndarray, valid: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """tokens, doc: [B, T+1] → input_ids, labels, doc_ids: [B, T] int64; doc ids restart at 0 per row."""
    same_doc = doc[:, 1:] == doc[:, :-1]
    if valid is not None:
        same_doc &= valid[:, 1:]
    labels = np.where(same_doc, tokens[:, 1:], IGNORE_INDEX)
    doc_ids = doc[:, :-1] - doc[:, :1]
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(labels)),
        "doc_ids": torch.from_numpy(np.ascontiguousarray(doc_ids)),
    }


class RowPosition:
    """A row loader's resumable position: rows handed out so far, valid only for the seed, row length and epoch
    size it was counted with. Subclasses set seed, seq_len, epoch_tokens and _next_row."""
    seed: int
    seq_len: int
    epoch_tokens: int
    _next_row: int

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed so far (tokens fed as inputs / tokens per epoch)."""
        return self._next_row * self.seq_len / self.epoch_tokens

    def state_dict(self) -> dict[str, int]:
        """The loader's position (plus the settings it is only valid for)."""
        return {"next_row": self._next_row, "seed": self.seed, "seq_len": self.seq_len,
                "epoch_tokens": self.epoch_tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; the settings must match the ones the state was saved with."""
        for key in ("seed", "seq_len", "epoch_tokens"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"loader state was saved with {key}={state[key]}, this loader has "
                                 f"{key}={getattr(self, key)}")
        next_row = int(state["next_row"])
        if next_row < 0:
            raise ValueError(f"next_row must be >= 0, got {next_row}")
        self._next_row = next_row


class PackedLoader(RowPosition):
    """Endless, deterministic, resumable batches of packed documents.

    token_docs: list of documents, each a list of token ids (without bos/eos).
    next_batch() -> {"input_ids": [B, T], "labels": [B, T], "doc_ids": [B, T]}, all int64, where
    labels[b, t] = input_ids[b, t + 1] (or the row's extra last token) when that token is in the same
    document, else -100; doc_ids are equal exactly for positions of the same document within a row.
    """

    def __init__(self, token_docs: Sequence[Sequence[int]], seq_len: int, batch_size: int, seed: int,
                 bos_id: int, eos_id: int, pad_id: int | None = None):
        _check_common(token_docs, seq_len, batch_size)
        self.token_docs = token_docs
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = int(seed)
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.pad_id = self.eos_id if pad_id is None else int(pad_id)
        self.epoch_tokens = sum(len(d) + 2 for d in token_docs)  # every epoch has the same length
        self._next_row = 0
        self._cached_epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}


    # --- batches ----------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document indices in the order epoch `epoch` lays them out."""
        return np.random.default_rng(self.seed + epoch).permutation(len(self.token_docs))

    def _epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._cached_epochs:
            if len(self._cached_epochs) >= 2:  # a row spans at most two neighbouring epochs
                self._cached_epochs.pop(min(self._cached_epochs))
            self._cached_epochs[epoch] = _framed_stream(self.token_docs, self.epoch_order(epoch),
                                                        self.bos_id, self.eos_id)
        return self._cached_epochs[epoch]

    def _stream_slice(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and globally unique document numbers of stream[start : start + count]."""
        n_docs = len(self.token_docs)
        tokens, docs = [], []
        while count > 0:
            epoch, offset = divmod(start, self.epoch_tokens)
            stream, slot = self._epoch_stream(epoch)
            take = min(count, self.epoch_tokens - offset)
            tokens.append(stream[offset:offset + take])
            docs.append(slot[offset:offset + take] + epoch * n_docs)
            start, count = start + take, count - take
        return np.concatenate(tokens), np.concatenate(docs)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next [batch_size, seq_len] batch (see the class docstring)."""
        T = self.seq_len
        rows = [self._stream_slice((self._next_row + b) * T, T + 1) for b in range(self.batch_size)]
        self._next_row += self.batch_size
        return _rows_to_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))

    def __iter__(self):
        while True:
            yield self.next_batch()

    def eval_batches(self, seq_len: int | None = None, batch_size: int | None = None) -> list[dict[str, torch.Tensor]]:
        """A finite, deterministic pass over this loader's documents in their given order (no shuffle).

        Every predictable token is a label exactly once; see `eval_batches`. Does not move the loader.
        """
        return eval_batches(self.token_docs, seq_len or self.seq_len, batch_size or self.batch_size,
                            self.bos_id, self.eos_id, self.pad_id)


def eval_batches(token_docs: Sequence[Sequence[int]], seq_len: int, batch_size: int, bos_id: int, eos_id: int,
                 pad_id: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Validation batches covering `token_docs` once, in order, packed like PackedLoader's rows.

    The stream of [bos] + doc + [eos] is cut into ceil((L - 1) / T) rows with stride T; the last row is
    right-padded with `pad_id` (default eos_id) and label -100; the last batch may have fewer rows.
    Returns a list of {"input_ids", "labels", "doc_ids"}: [B, T] int64.
    """
    _check_common(token_docs, seq_len, batch_size)
    pad_id = eos_id if pad_id is None else pad_id
    tokens, docs = _framed_stream(token_docs, range(len(token_docs)), bos_id, eos_id)
    T = seq_len
    n_rows = -(-(len(tokens) - 1) // T)
    padded_len = n_rows * T + 1
    pad = padded_len - len(tokens)
    valid = np.concatenate((np.ones(len(tokens), dtype=bool), np.zeros(pad, dtype=bool)))
    tokens = np.concatenate((tokens, np.full(pad, pad_id, dtype=np.int64)))
    # Padding gets its own document number so it never shares a document with real tokens.
    docs = np.concatenate((docs, np.full(pad, len(token_docs), dtype=np.int64)))
    starts = np.arange(n_rows) * T
    window = starts[:, None] + np.arange(T + 1)[None, :]
    batches = []
    for first in range(0, n_rows, batch_size):
        index = window[first:first + batch_size]
        batches.append(_rows_to_batch(tokens[index], docs[index], valid[index]))
    return batches
