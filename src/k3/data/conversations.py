"""Training on conversations: OpenAI-format JSONL records (`{"messages": [...], "tools": [...]}`) rendered with K3's
chat template (SPEC §1.2), with the loss on what the model writes as the assistant and nothing else: each assistant
message from its think section through `<|end_of_msg|>` (reasoning, response, tool calls, and the end of the turn,
so that it learns to stop). System, user and tool text, and the `<|open|>message role="assistant"<|sep|>` that the
server's generation prompt supplies, are context only.

Conversations are packed into rows like documents (k3.data.packing), with no BOS (the chat markup has none) and
labels only where the next token is one to learn and belongs to the same conversation."""
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


def _stream(convs: Sequence[tuple[list[int], list[bool]]], order) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenated (tokens, conversation number, learn) of the conversations in `order`."""
    tokens = np.concatenate([np.asarray(convs[i][0], dtype=np.int64) for i in order])
    slot = np.concatenate([np.full(len(convs[i][0]), k, dtype=np.int64) for k, i in enumerate(order)])
    learn = np.concatenate([np.asarray(convs[i][1], dtype=bool) for i in order])
    return tokens, slot, learn


class ConversationLoader(RowPosition):
    """Endless, deterministic, resumable batches of packed conversations: PackedLoader's interface (next_batch,
    state_dict, load_state_dict, epoch) and row layout, with labels only on the assistant's tokens."""

    def __init__(self, convs: Sequence[tuple[list[int], list[bool]]], seq_len: int, batch_size: int, seed: int):
        if not convs:
            raise ValueError("convs must hold at least one conversation")
        self.convs, self.seq_len, self.batch_size, self.seed = convs, seq_len, batch_size, int(seed)
        self.epoch_tokens = sum(len(c[0]) for c in convs)
        self._next_row = 0
        self._epochs: dict[int, tuple] = {}

    def _epoch(self, e: int):
        if e not in self._epochs:
            if len(self._epochs) >= 2:  # a row spans at most two neighbouring epochs
                self._epochs.pop(min(self._epochs))
            order = np.random.default_rng(self.seed + e).permutation(len(self.convs))
            self._epochs[e] = _stream(self.convs, order)
        return self._epochs[e]

    def _slice(self, start: int, count: int):
        n = len(self.convs)
        parts = []
        while count > 0:
            e, offset = divmod(start, self.epoch_tokens)
            tokens, slot, learn = self._epoch(e)
            take = min(count, self.epoch_tokens - offset)
            sl = slice(offset, offset + take)
            parts.append((tokens[sl], slot[sl] + e * n, learn[sl]))
            start, count = start + take, count - take
        return [np.concatenate(x) for x in zip(*parts)]

    def next_batch(self) -> dict[str, torch.Tensor]:
        T = self.seq_len
        rows = [self._slice((self._next_row + b) * T, T + 1) for b in range(self.batch_size)]
        self._next_row += self.batch_size
        return _rows_to_batch(*(np.stack([r[k] for r in rows]) for k in range(3)))


def conversation_eval_batches(convs: Sequence[tuple[list[int], list[bool]]], seq_len: int, batch_size: int,
                              pad_id: int) -> list[dict[str, torch.Tensor]]:
    """One ordered pass over `convs`, packed into rows like ConversationLoader's (the last row padded, unlearned):
    every assistant token is a label exactly once."""
    tokens, slot, learn = _stream(convs, range(len(convs)))
    T = seq_len
    n_rows = -(-(len(tokens) - 1) // T)
    pad = n_rows * T + 1 - len(tokens)
    tokens = np.concatenate((tokens, np.full(pad, pad_id, dtype=np.int64)))
    slot = np.concatenate((slot, np.full(pad, len(convs), dtype=np.int64)))
    learn = np.concatenate((learn, np.zeros(pad, dtype=bool)))
    window = (np.arange(n_rows) * T)[:, None] + np.arange(T + 1)[None, :]
    return [_rows_to_batch(tokens[w], slot[w], learn[w]) for w in
            (window[i:i + batch_size] for i in range(0, n_rows, batch_size))]
