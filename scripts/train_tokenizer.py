"""Train k3's byte-level BPE tokenizer on the training split of the bundled corpus.

Vocabulary: the 10 special tokens at ids 0..9, the 256 byte symbols, then BPE merges up to 8192 ids.
The result (`src/k3/data/assets/tokenizer.json`) is deterministic for a given corpus and split.

    python scripts/train_tokenizer.py [--output PATH] [--vocab-size 8192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3.data.corpus import load_corpus, split_documents
from k3.data.tokenizer import DEFAULT_TOKENIZER_PATH, SPECIAL_TOKENS, VOCAB_SIZE


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE over `texts` with exactly `vocab_size` ids, specials first."""
    tokenizer = Tokenizer(models.BPE())
    # No normaliser: byte-level pre-tokenisation keeps every byte, so decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise SystemExit(f"trained vocabulary has {got} ids, wanted {vocab_size} (corpus too small?)")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise SystemExit(f"special token {token} got id {tokenizer.token_to_id(token)}, wanted {expected_id}")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=None, help="corpus .jsonl.xz (default: bundled)")
    parser.add_argument("--output", type=Path, default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    train_docs, _ = split_documents(load_corpus(args.corpus))
    tokenizer = train_tokenizer([d.text for d in train_docs], args.vocab_size)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.output), pretty=False)
    print(f"wrote {args.output}: {tokenizer.get_vocab_size()} ids, trained on {len(train_docs)} works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
