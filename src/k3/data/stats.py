"""Unigram baselines: what a model that ignores context would score, in nats per token."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def _as_ids(ids, name: str, vocab_size: int) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64).reshape(-1)
    if array.size == 0:
        raise ValueError(f"{name} must hold at least one token id")
    if array.min() < 0 or array.max() >= vocab_size:
        raise ValueError(f"{name} holds ids outside [0, {vocab_size}): min {array.min()}, max {array.max()}")
    return array


def unigram_cross_entropy(train_ids: Sequence[int], val_ids: Sequence[int], vocab_size: int) -> float:
    """Mean -log p(v) over val_ids, with p(v) = (count_train(v) + 1) / (n_train + vocab_size).

    train_ids, val_ids: flat sequences (list, numpy array or tensor) of ids in [0, vocab_size).
    Add-one smoothing keeps unseen validation tokens finite. Returns nats per token.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    train = _as_ids(train_ids, "train_ids", vocab_size)
    val = _as_ids(val_ids, "val_ids", vocab_size)
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    log_prob = np.log(counts + 1.0) - np.log(train.size + vocab_size)
    return float(-log_prob[val].mean())


def unigram_entropy(token_ids: Sequence[int], vocab_size: int) -> float:
    """Entropy (nats) of the empirical unigram distribution of token_ids, no smoothing."""
    ids = _as_ids(token_ids, "token_ids", vocab_size)
    counts = np.bincount(ids, minlength=vocab_size)
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum())
