"""Training on conversations: OpenAI-format JSONL records (`{"messages": [...], "tools": [...]}`) rendered with K3's
chat template (SPEC §1.2), with the loss on what the model writes as the assistant and nothing else: each assistant
message from its think section through `<|end_of_msg|>` (reasoning, response, tool calls, and the end of the turn,
so that it learns to stop). System, user and tool text, and the `<|open|>message role="assistant"<|sep|>` that the
server's generation prompt supplies, are context only.

Conversations are packed whole into rows (first fit, the rest of a row padded and unlearned), with no BOS (the chat
markup has none) and labels only where the next token is one to learn and belongs to the same conversation. Whole,
because a conversation cut at a row boundary would continue in the next row without its beginning: the answer's
numbers would be labels with the question out of sight, teaching the model to guess what it should copy. Only a
conversation longer than a row is cut, into windows of its own."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from k3.data.chat_template import END_OF_MSG, OPEN, SEP, Marker, parts_to_ids, render_parts
from k3.data.packing import RowPosition, _rows_to_batch


class ConversationError(ValueError):
    """A conversation file or record that cannot be trained on; the message names the line and field."""


def load_conversations(path) -> list[dict]:
    """Records of a JSONL file: each an object with `messages` (a non-empty list) and optionally `tools`, and the
    chat template's `thinking` (default true) and `thinking_effort`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    records = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConversationError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or not rec["messages"]:
                raise ConversationError(f"{path}:{n}: a record must be an object with a non-empty 'messages' list")
            if rec.get("tools") is not None and not isinstance(rec["tools"], list):
                raise ConversationError(f"{path}:{n}: 'tools' must be a list")
            records.append(rec)
    if not records:
        raise ConversationError(f"{path}: holds no conversations")
    return records


def render_conversation(tokenizer, record: dict, where: str = "record") -> tuple[list[int], list[bool]]:
    """→ (ids, learn): learn[i] is True for the ids the model must predict (its assistant turns)."""
    try:
        parts, _ = render_parts(record["messages"], tools=record.get("tools"),
                                thinking=record.get("thinking", True), thinking_effort=record.get("thinking_effort"))
    except ValueError as e:
        raise ConversationError(f"{where}: {e}") from None
    ids, offsets = parts_to_ids(parts, tokenizer)
    learn = [False] * len(ids)
    start = None  # id position where the current assistant message's written part begins
    for k, part in enumerate(parts):
        if (isinstance(part, str) and part.startswith('message role="assistant"') and k >= 1
                and parts[k - 1] == Marker(OPEN) and k + 1 < len(parts) and parts[k + 1] == Marker(SEP)):
            start = offsets[k + 1]  # after `<|open|>message role="assistant"<|sep|>`
        elif part == Marker(END_OF_MSG) and start is not None:
            learn[start:offsets[k]] = [True] * (offsets[k] - start)
            start = None
    return ids, learn


def render_conversations(tokenizer, records: Sequence[dict]) -> list[tuple[list[int], list[bool]]]:
    out = []
    for i, rec in enumerate(records):
        ids, learn = render_conversation(tokenizer, rec, f"record {i}")
        if not any(learn):
            raise ConversationError(f"record {i}: has no assistant message to learn from")
        out.append((ids, learn))
    return out


def _pack_rows(lengths: Sequence[int], order, row_len: int) -> list[list[int]]:
    """First-fit packing of conversations (in `order`) into rows of `row_len` tokens → each row's conversation
    indices, in placement order. A conversation longer than a row gets rows of its own, ceil(len / (row_len - 1))
    windows that share one token (each token an input once)."""
    rows: list[list[int]] = []
    space = np.zeros(0, dtype=np.int64)
    for i in order:
        n = lengths[i]
        if n > row_len:
            rows.extend([i] for _ in range(-(-(n - 1) // (row_len - 1))))
            space = np.concatenate((space, np.zeros(len(rows) - len(space), dtype=np.int64)))
            continue
        fits = np.flatnonzero(space >= n)
        if len(fits):
            rows[fits[0]].append(i)
            space[fits[0]] -= n
        else:
            rows.append([i])
            space = np.append(space, row_len - n)
    return rows


def _row_arrays(convs, row: list[int], window: int, row_len: int, pad_id: int, first_slot: int):
    """(tokens, conversation number, learn) of one packed row of `row_len` tokens, padded with `pad_id` (its own
    number, never learned). `window` picks the part of a conversation longer than a row."""
    tokens = np.full(row_len, pad_id, dtype=np.int64)
    slot = np.full(row_len, first_slot + len(row), dtype=np.int64)
    learn = np.zeros(row_len, dtype=bool)
    at = 0
    for k, i in enumerate(row):
        ids, lrn = np.asarray(convs[i][0], dtype=np.int64), np.asarray(convs[i][1], dtype=bool)
        if len(ids) > row_len:
            cut = window * (row_len - 1)
            ids, lrn = ids[cut:cut + row_len], lrn[cut:cut + row_len]
        tokens[at:at + len(ids)], slot[at:at + len(ids)], learn[at:at + len(ids)] = ids, first_slot + k, lrn
        at += len(ids)
    return tokens, slot, learn


def _windows(rows: list[list[int]]) -> list[int]:
    """For each row, which window of its conversation it holds (0 except for the parts of a long conversation)."""
    out, prev = [], None
    for row in rows:
        out.append(out[-1] + 1 if len(row) == 1 and row == prev else 0)
        prev = row
    return out


class ConversationLoader(RowPosition):
    """Endless, deterministic, resumable batches of packed conversations: PackedLoader's interface (next_batch,
    state_dict, load_state_dict, epoch), with rows of seq_len + 1 tokens (inputs the first seq_len, labels the last)
    and labels only on the assistant's tokens. Epoch e packs the conversations in
    `default_rng(seed + e).permutation(n)` order; the position is the number of rows handed out."""

    def __init__(self, convs: Sequence[tuple[list[int], list[bool]]], seq_len: int, batch_size: int, seed: int,
                 pad_id: int = 2):
        if not convs:
            raise ValueError("convs must hold at least one conversation")
        self.convs, self.seq_len, self.batch_size, self.seed = convs, seq_len, batch_size, int(seed)
        self.pad_id = int(pad_id)
        self.epoch_tokens = sum(len(c[0]) for c in convs)
        self._lengths = [len(c[0]) for c in convs]
        self._next_row = 0
        self._epoch_rows: dict[int, tuple[list[list[int]], list[int]]] = {}  # e → (rows, windows); two kept
        self._epoch_starts = [0]  # first row of epoch e (epochs pack into different row counts)

    def _rows(self, e: int):
        if e not in self._epoch_rows:
            if len(self._epoch_rows) >= 2:
                self._epoch_rows.pop(min(self._epoch_rows))
            order = np.random.default_rng(self.seed + e).permutation(len(self.convs))
            rows = _pack_rows(self._lengths, order, self.seq_len + 1)
            self._epoch_rows[e] = rows, _windows(rows)
        return self._epoch_rows[e]

    def _row(self, r: int):
        while r >= self._epoch_starts[-1]:  # count the rows of each epoch up to r's, once
            self._epoch_starts.append(self._epoch_starts[-1] + len(self._rows(len(self._epoch_starts) - 1)[0]))
        e = int(np.searchsorted(self._epoch_starts, r, side="right")) - 1
        rows, windows = self._rows(e)
        r -= self._epoch_starts[e]
        return _row_arrays(self.convs, rows[r], windows[r], self.seq_len + 1, self.pad_id, 0)

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = [self._row(self._next_row + b) for b in range(self.batch_size)]
        self._next_row += self.batch_size
        return _rows_to_batch(*(np.stack([r[k] for r in rows]) for k in range(3)))


def conversation_eval_batches(convs: Sequence[tuple[list[int], list[bool]]], seq_len: int, batch_size: int,
                              pad_id: int) -> list[dict[str, torch.Tensor]]:
    """One ordered pass over `convs`, packed into rows like ConversationLoader's: every assistant token is a label
    exactly once."""
    rows = _pack_rows([len(c[0]) for c in convs], range(len(convs)), seq_len + 1)
    arrays = [_row_arrays(convs, row, w, seq_len + 1, pad_id, 0) for row, w in zip(rows, _windows(rows))]
    return [_rows_to_batch(*(np.stack([a[k] for a in arrays[i:i + batch_size]]) for k in range(3)))
            for i in range(0, len(arrays), batch_size)]
