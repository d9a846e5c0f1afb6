"""Data for k3's small training runs: the bundled Shakespeare corpus, its BPE tokenizer and row packing; the released
tokenizer files and K3's chat markup (`load_tokenizer(path).apply_chat_template(...)`)."""
from __future__ import annotations

from typing import Sequence

from k3.data.corpus import CorpusError, Document, load_corpus, split_documents
from k3.data.packing import IGNORE_INDEX, PackedLoader, eval_batches
from k3.data.stats import unigram_cross_entropy, unigram_entropy
from k3.data.tokenizer import (SPECIAL_TOKENS, ChatTokenizerMixin, StreamDecoder, Tokenizer, TokenizerError,
                               load_tokenizer, model_tokenizer)


def load_token_docs(tokenizer: Tokenizer, docs: Sequence[Document]) -> list[list[int]]:
    """Token ids of each document's text (no bos/eos; PackedLoader adds those), encoded in one batch."""
    return tokenizer.encode_batch([doc.text for doc in docs])


__all__ = [
    "CorpusError", "Document", "load_corpus", "split_documents",
    "Tokenizer", "TokenizerError", "StreamDecoder", "SPECIAL_TOKENS", "load_tokenizer", "model_tokenizer",
    "ChatTokenizerMixin",
    "PackedLoader", "eval_batches", "IGNORE_INDEX",
    "unigram_cross_entropy", "unigram_entropy", "load_token_docs",
]
