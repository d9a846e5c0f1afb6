"""The released-format tokenizer (tiktoken.model + tokenizer_config.json), on a small file of our own."""
import base64
import json

import pytest

pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")

from k3.data.tiktoken_loader import TiktokenTokenizerError, has_tiktoken_files, load_tiktoken_tokenizer  # noqa: E402

MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ng", b"ing"]
SPECIALS = {300: "[BOS]", 302: "<|end_of_msg|>", 303: "<|open|>", 304: "<|close|>", 305: "<|sep|>", 310: "[PAD]"}


def write_tokenizer(d, specials=SPECIALS, bos="[BOS]", eos="<|end_of_msg|>"):
    ranks = [bytes([b]) for b in range(256)] + MERGES  # byte-level base, then merges in priority order
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    cfg = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in specials.items()},
           "bos_token": bos, "eos_token": {"content": eos}, "pad_token": "[PAD]",
           "tokenizer_class": "TikTokenTokenizer"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def tok(tmp_path):
    return load_tiktoken_tokenizer(write_tokenizer(tmp_path))


def test_files_detected_and_ids_as_declared(tok, tmp_path):
    assert has_tiktoken_files(tmp_path)
    assert tok.special_tokens == {c: i for i, c in SPECIALS.items()}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (300, 302, 310)
    assert tok.vocab_size == 311  # the highest declared id + 1


def test_bpe_merges_follow_the_ranks(tok):
    base = 256
    assert tok.encode("the") == [base + MERGES.index(b"the")]
    assert tok.encode(" the") == [base + MERGES.index(b" the")]
    assert tok.encode("thing") == [base + MERGES.index(b"th"), base + MERGES.index(b"ing")]
    assert tok.encode("x") == [ord("x")]  # unmerged bytes are their own rank


def test_round_trip_and_specials(tok):
    text = "KING HENRY: the thing, naïve 日本 😀\n\n  end"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|open|>user<|sep|>hi<|close|>", add_bos=True, add_eos=True)
    assert ids[0] == 300 and ids[1] == 303 and 305 in ids and ids[-2:] == [304, 302]
    assert tok.decode(ids, skip_special_tokens=True) == "userhi"
    assert 303 not in tok.encode("<|open|>", allow_special=False)  # as plain text when specials are not allowed
    assert tok.token_to_id("<|sep|>") == 305 and tok.token_to_id("the") == 256 + MERGES.index(b"the")


def test_bad_directories_raise_clear_errors(tmp_path):
    with pytest.raises(TiktokenTokenizerError, match="tiktoken.model"):
        load_tiktoken_tokenizer(tmp_path)
    a = write_tokenizer(tmp_path / "a" if (tmp_path / "a").mkdir() is None else None, specials={100: "[BOS]", 302: "x"})
    with pytest.raises(TiktokenTokenizerError, match="is a BPE rank"):
        load_tiktoken_tokenizer(a)
    b = write_tokenizer(tmp_path / "b" if (tmp_path / "b").mkdir() is None else None, bos="<s>")
    with pytest.raises(TiktokenTokenizerError, match="bos_token '<s>'"):
        load_tiktoken_tokenizer(b)
    with pytest.raises(TiktokenTokenizerError, match="outside the vocabulary"):
        load_tiktoken_tokenizer(write_tokenizer(tmp_path)).decode([311])
