"""Tests for k3.data: bundled corpus, tokenizer, packing and unigram statistics."""
from __future__ import annotations

import json
import lzma
import math
import random

import numpy as np
import pytest
import torch

from k3.data import (IGNORE_INDEX, CorpusError, Document, PackedLoader, Tokenizer, TokenizerError, eval_batches,
                     load_corpus, load_token_docs, split_documents, unigram_cross_entropy, unigram_entropy)
from k3.data import tokenizer as tokenizer_module

EXPECTED_SPECIALS = ["<|bos|>", "<|end_of_msg|>", "<|pad|>", "<|open|>", "<|close|>", "<|sep|>",
                     "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file()


# --- corpus -----------------------------------------------------------------------------------------
def test_corpus_has_the_works(corpus):
    assert len(corpus) >= 30
    titles = [d.title for d in corpus]
    assert len(set(titles)) == len(titles)
    assert all(isinstance(d, Document) and len(d.text) > 1000 for d in corpus)
    by_title = {d.title: d.text for d in corpus}
    assert "To be, or not to be" in by_title["Hamlet"]
    # Gutenberg licence boilerplate must be gone.
    assert not any("Project Gutenberg" in d.text or "START OF" in d.text for d in corpus)


def test_split_is_by_whole_document_disjoint_and_deterministic(corpus):
    train, val = split_documents(corpus)
    assert len(train) >= 1 and len(val) >= 1
    assert len(train) + len(val) == len(corpus)
    assert {d.title for d in train}.isdisjoint({d.title for d in val})
    # Whole documents: every split document is identical to one corpus document.
    assert set(train) | set(val) == set(corpus)
    assert split_documents(corpus) == (train, val)
    assert len(val) == round(0.08 * len(corpus))
    other_train, other_val = split_documents(corpus, seed=1)
    assert {d.title for d in other_val} != {d.title for d in val}


def test_split_keeps_one_document_each_side():
    docs = [Document(f"t{i}", "x") for i in range(3)]
    train, val = split_documents(docs, val_fraction=0.01)
    assert len(val) == 1 and len(train) == 2
    train, val = split_documents(docs, val_fraction=0.99)
    assert len(train) == 1 and len(val) == 2
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, val_fraction=1.5)
    with pytest.raises(ValueError, match="at least 2"):
        split_documents(docs[:1])


def test_missing_and_corrupt_corpus_files(tmp_path):
    missing = tmp_path / "nope.jsonl.xz"
    with pytest.raises(FileNotFoundError, match="nope.jsonl.xz"):
        load_corpus(missing)
    not_xz = tmp_path / "not_xz.jsonl.xz"
    not_xz.write_bytes(b"plain bytes, not xz")
    with pytest.raises(CorpusError, match="not_xz.jsonl.xz.*xz"):
        load_corpus(not_xz)
    bad_json = tmp_path / "bad_json.jsonl.xz"
    bad_json.write_bytes(lzma.compress(b'{"title": "a", "text": "b"}\n{"title": oops}\n'))
    with pytest.raises(CorpusError, match="bad_json.jsonl.xz, line 2"):
        load_corpus(bad_json)
    wrong_fields = tmp_path / "fields.jsonl.xz"
    wrong_fields.write_bytes(lzma.compress(json.dumps({"name": "a"}).encode()))
    with pytest.raises(CorpusError, match="title"):
        load_corpus(wrong_fields)
    assert issubclass(CorpusError, ValueError)


# --- tokenizer ----------------------------------------------------------------------------------------
def test_tokenizer_vocabulary_and_special_ids(tok):
    assert tok.vocab_size == 8192
    assert list(tok.special_tokens) == EXPECTED_SPECIALS
    assert list(tok.special_tokens.values()) == list(range(10))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    for name, token_id in tok.special_tokens.items():
        assert tok.encode(name) == [token_id]  # one id, not pieces of "<", "|", ...
        assert tok.token_to_id(name) == token_id
        assert tok.decode([token_id]) == name
    with pytest.raises(KeyError):
        tok.token_to_id("<|no such token|>")


def _random_text(rng: random.Random, length: int) -> str:
    # Mix of ASCII, whitespace runs, accents, CJK, emoji and the odd special-token text.
    alphabet = list("abcXYZ .,;:'!?\n\n\t\r ") + ["é", "ß", "ω", "日", "本", "🙂", "👍🏽", "\u0301", "\x00", "\u00a0",
                                                    "\u2028", "\x1c", "<|sep|>"]
    chars = [rng.choice(alphabet) if rng.random() < 0.6 else chr(rng.randrange(0x20, 0x2FFF)) for _ in range(length)]
    return "".join(c for c in chars if not 0xD800 <= ord(c[0]) <= 0xDFFF)


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randrange(0, 120))
        ids = tok.encode(text)
        assert all(0 <= i < 8192 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(ids).encode("utf-8") == text.encode("utf-8")


def test_round_trip_corpus_excerpts(tok, corpus):
    rng = random.Random(1)
    for doc in corpus[::5]:
        start = rng.randrange(0, len(doc.text) - 3000)
        excerpt = doc.text[start:start + 3000]
        assert tok.decode(tok.encode(excerpt)) == excerpt
    bos_eos = tok.encode("Hamlet.", add_bos=True, add_eos=True)
    assert bos_eos[0] == tok.bos_id and bos_eos[-1] == tok.eos_id
    assert tok.decode(bos_eos, skip_special_tokens=True) == "Hamlet."


def test_chunked_batch_encoding_equals_plain_encoding(tok, corpus, monkeypatch):
    backend = tok.backend
    short_docs = sorted(corpus, key=lambda d: len(d.text))[:3]
    texts = [d.text for d in short_docs] + [_random_text(random.Random(2), 3000) for _ in range(3)]
    reference = [backend.encode(t, add_special_tokens=False).ids for t in texts]
    monkeypatch.setattr(tokenizer_module, "_CHUNK_CHARS", 16)  # force many cuts
    assert tok.encode_batch(texts) == reference
    assert load_token_docs(tok, short_docs) == reference[:3]


@pytest.mark.parametrize("use_library", [True, False])
def test_stream_decoding_pieces_concatenate_to_full_decode(tok, use_library):
    text = "Ay, 日本語 and 🙂👍🏽 — O Romeo, Romeo! wherefore art thou Romeo?\n"
    ids = tok.encode(text)
    stream = tokenizer_module.StreamDecoder(tok, use_library=use_library)
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # At least one emoji spans several byte tokens, so some step must have waited.
    assert "" in pieces


def test_missing_and_corrupt_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.json"):
        Tokenizer.from_file(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerError, match="broken.json"):
        Tokenizer.from_file(broken)


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match="8192"):
        tok.decode([5, 8192])


# --- packing ------------------------------------------------------------------------------------------
BOS, EOS = 0, 1


def _unique_docs(lengths):
    """Documents whose tokens are globally unique ids >= 10, so positions can be traced."""
    docs, next_id = [], 10
    for n in lengths:
        docs.append(list(range(next_id, next_id + n)))
        next_id += n
    return docs


def _owner_of(docs):
    return {token: i for i, doc in enumerate(docs) for token in doc}


def test_packing_shapes_and_labels_never_cross_documents():
    docs = _unique_docs([5, 17, 1, 40, 9, 23])
    owner = _owner_of(docs)
    loader = PackedLoader(docs, seq_len=12, batch_size=3, seed=0, bos_id=BOS, eos_id=EOS)
    for _ in range(10):
        batch = loader.next_batch()
        for key in ("input_ids", "labels", "doc_ids"):
            assert batch[key].shape == (3, 12) and batch[key].dtype == torch.int64
        x, y, d = batch["input_ids"], batch["labels"], batch["doc_ids"]
        # Shifted-by-one within a row: a label, where present, is the next input.
        inner = y[:, :-1] != IGNORE_INDEX
        assert torch.equal(y[:, :-1][inner], x[:, 1:][inner])
        # Labels are masked exactly where the next position is another document.
        next_same = d[:, 1:] == d[:, :-1]
        assert torch.equal(inner, next_same)
        for b in range(3):
            for t in range(12):
                token, label = int(x[b, t]), int(y[b, t])
                if token >= 10 and label >= 10:
                    assert owner[token] == owner[label]
                if token == EOS:  # after an eos comes the next document's bos: never a target
                    assert label == IGNORE_INDEX
                if token >= 10 and t + 1 < 12 and int(x[b, t + 1]) >= 10:
                    same = owner[token] == owner[int(x[b, t + 1])]
                    assert same == bool(d[b, t] == d[b, t + 1])


def test_every_token_is_an_input_once_per_epoch():
    docs = _unique_docs([7, 30, 2, 11, 19])
    loader = PackedLoader(docs, seq_len=8, batch_size=2, seed=3, bos_id=BOS, eos_id=EOS)
    epoch_len = sum(len(d) + 2 for d in docs)
    inputs = []
    while len(inputs) < epoch_len:
        inputs.extend(loader.next_batch()["input_ids"].reshape(-1).tolist())
    epoch = inputs[:epoch_len]
    content = [t for t in epoch if t >= 10]
    assert sorted(content) == sorted(t for d in docs for t in d)
    assert epoch.count(BOS) == len(docs) and epoch.count(EOS) == len(docs)
    # Documents appear whole and in order: bos, its tokens, eos.
    expected_order = loader.epoch_order(0).tolist()
    rebuilt = [t for i in expected_order for t in [BOS, *docs[i], EOS]]
    assert epoch == rebuilt


def test_resume_from_state_dict_continues_identically():
    docs = _unique_docs([13, 4, 29, 8, 50, 3])
    reference = PackedLoader(docs, seq_len=10, batch_size=4, seed=7, bos_id=BOS, eos_id=EOS)
    stream = [reference.next_batch() for _ in range(12)]  # spans several epochs
    first = PackedLoader(docs, seq_len=10, batch_size=4, seed=7, bos_id=BOS, eos_id=EOS)
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    resumed = PackedLoader(docs, seq_len=10, batch_size=4, seed=7, bos_id=BOS, eos_id=EOS)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    for expected in stream[5:]:
        got = resumed.next_batch()
        for key in expected:
            assert torch.equal(got[key], expected[key])
    wrong = PackedLoader(docs, seq_len=11, batch_size=4, seed=7, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="seq_len"):
        wrong.load_state_dict(state)


def test_seeds_and_epochs_change_the_order():
    docs = _unique_docs([3] * 12)
    a = PackedLoader(docs, seq_len=4, batch_size=1, seed=0, bos_id=BOS, eos_id=EOS)
    b = PackedLoader(docs, seq_len=4, batch_size=1, seed=1, bos_id=BOS, eos_id=EOS)
    assert a.epoch_order(0).tolist() != b.epoch_order(0).tolist()
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()
    assert sorted(a.epoch_order(1).tolist()) == list(range(12))
    assert not torch.equal(a.next_batch()["input_ids"], b.next_batch()["input_ids"])


def test_eval_batches_cover_validation_targets_once():
    docs = _unique_docs([6, 1, 20, 9])
    batches = eval_batches(docs, seq_len=8, batch_size=3, bos_id=BOS, eos_id=EOS, pad_id=2)
    assert eval_batches(docs, 8, 3, BOS, EOS, 2)[0]["input_ids"].tolist() == batches[0]["input_ids"].tolist()
    labels = torch.cat([b["labels"].reshape(-1) for b in batches]).tolist()
    targets = [t for t in labels if t != IGNORE_INDEX]
    # Every document token and every eos is predicted exactly once; bos never is.
    assert sorted(targets) == sorted([t for d in docs for t in d] + [EOS] * len(docs))
    assert all(b["input_ids"].shape[1] == 8 for b in batches)
    assert all(b["input_ids"].shape[0] <= 3 for b in batches)
    loader = PackedLoader(docs, seq_len=8, batch_size=3, seed=0, bos_id=BOS, eos_id=EOS, pad_id=2)
    assert all(torch.equal(p["labels"], q["labels"]) for p, q in zip(loader.eval_batches(), batches))


def test_packing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader([[5]], seq_len=0, batch_size=1, seed=0, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="batch_size"):
        PackedLoader([[5]], seq_len=4, batch_size=0, seed=0, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="at least one document"):
        PackedLoader([], seq_len=4, batch_size=1, seed=0, bos_id=BOS, eos_id=EOS)


# --- statistics --------------------------------------------------------------------------------------
def test_unigram_cross_entropy_by_hand():
    # Vocabulary of 4, train = [0, 0, 1] -> add-one counts 3, 2, 1, 1 over 3 + 4 = 7.
    # Val = [0, 2, 3]: -(log 3/7 + log 1/7 + log 1/7) / 3.
    expected = -(math.log(3 / 7) + 2 * math.log(1 / 7)) / 3
    assert unigram_cross_entropy([0, 0, 1], [0, 2, 3], vocab_size=4) == pytest.approx(expected, rel=1e-12)
    assert unigram_cross_entropy(np.array([0, 0, 1]), torch.tensor([0, 2, 3]), 4) == pytest.approx(expected)
    # Entropy of [0, 0, 1, 1]: two equally likely symbols, log 2.
    assert unigram_entropy([0, 0, 1, 1], vocab_size=4) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="val_ids"):
        unigram_cross_entropy([0], [4], vocab_size=4)
    with pytest.raises(ValueError, match="train_ids"):
        unigram_cross_entropy([], [0], vocab_size=4)
