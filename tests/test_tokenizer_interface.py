"""One tokenizer interface over the bundled BPE and the released tiktoken files (SPEC §1.2): the built-in released
split pattern (run through tiktoken itself), load_tokenizer's dispatch, the Hugging Face-shaped surface, stop ids,
and marker text that encode_text keeps as text."""
import base64
import json
import os
from pathlib import Path

import pytest

from k3.data import Tokenizer, load_tokenizer

tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
from k3.data.tiktoken_loader import KIMI_PATTERN  # noqa: E402

# SPEC §1.2, character for character
SPEC_PATTERN = (r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&"""
                r"""[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&"""
                r"""[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# The released special block: name → offset from the first special id (163,584 in the released vocabulary)
RELEASED_SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
                     "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
                     "[PAD]": 255}
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world"]


def write_released_style_tokenizer(d: Path, merges=MERGES) -> Path:
    """A small tokenizer in the released layout: byte-level ranks, then merges, then a 256-id special block whose
    unnamed ids are <|reserved_token_N|>; tokenizer_config.json as released (no pat_str, eos_token [EOS])."""
    ranks = [bytes([b]) for b in range(256)] + list(merges)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    names = {v: k for k, v in RELEASED_SPECIALS.items()}
    first = len(ranks)
    added = {str(first + k): {"content": names.get(k, f"<|reserved_token_{k}|>"), "special": True} for k in range(256)}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "tokenizer_class": "TikTokenTokenizer"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def pieces(text: str) -> list[str]:
    """The pre-tokenisation pieces of `text` under the built-in pattern, as tiktoken's own regex engine cuts it:
    with every substring of the text in the vocabulary, BPE merges each piece into one token and no further."""
    data = text.encode()
    subs = sorted({data[i:j] for i in range(len(data)) for j in range(i + 1, len(data) + 1)}, key=lambda b: (len(b), b))
    enc = tiktoken.Encoding("pieces", pat_str=KIMI_PATTERN, mergeable_ranks={b: i for i, b in enumerate(subs)},
                            special_tokens={})
    return [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]


@pytest.fixture
def released(tmp_path):
    return load_tokenizer(write_released_style_tokenizer(tmp_path))


@pytest.fixture(scope="module")
def bundled():
    return load_tokenizer()


def test_builtin_pattern_is_specs():
    assert KIMI_PATTERN == SPEC_PATTERN


@pytest.mark.parametrize("text, want", [
    ("中文English混合", ["中文", "English", "混合"]),  # SPEC's example
    ("it's", ["it's"]),  # a contraction stays one piece (SPEC)
    ("IT'S we'RE", ["IT'S", " we'RE"]),  # the contraction suffix is case-insensitive
    ("HelloWorld CamelCaseXML", ["Hello", "World", " Camel", "Case", "XML"]),  # letter runs split at case changes
    ("1234567890", ["123", "456", "789", "0"]),
    ("Hello, world!", ["Hello", ",", " world", "!"]),
    ("def f(x):\n    return x", ["def", " f", "(x", "):\n", "   ", " return", " x"]),
    ("日本語のテキスト", ["日本語", "のテキスト"]),  # Han on its own; kana are other letters
])
def test_released_split_through_tiktoken(text, want):
    assert pieces(text) == want


RELEASED_DIR = os.environ.get("K3_KIMI_TOKENIZER")


@pytest.mark.skipif(not RELEASED_DIR, reason="set K3_KIMI_TOKENIZER to a directory with the released tiktoken.model "
                                              "and tokenizer_config.json (not redistributable here)")
def test_spec_reference_ids_with_the_released_files():
    tok = load_tokenizer(RELEASED_DIR)
    assert tok.encode("Hello world") == [19180, 2695]
    assert tok.encode("Hello, world!") == [19180, 11, 2695, 0]
    assert tok.encode("你好世界") == [33845, 2243]
    assert tok.encode("1234567890") == [6694, 12972, 16242, 15]
    assert tok.encode("中文English混合") == [16717, 44372, 13935]
    assert (tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("[EOS]")) == (163586, 163839, 163585)
    assert [tok.convert_tokens_to_ids(t) for t in ("<|open|>", "<|close|>", "<|sep|>")] == [163587, 163588, 163589]


def test_released_files_without_pat_str_use_the_builtin_pattern(released, tmp_path):
    assert released.encoding._pat_str == KIMI_PATTERN
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "pat_str": r"\S+|\s+"}))
    assert load_tokenizer(tmp_path).encoding._pat_str == r"\S+|\s+"  # the files' own pattern wins when given


def test_hugging_face_shaped_surface(released, bundled):
    first = 256 + len(MERGES)
    for tok, eom, bos, pad, stops in ((released, first + 2, first, first + 255, [first + 1, first + 2]),
                                      (bundled, 1, 0, 2, [1])):
        assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (eom, bos, pad)
        assert tok.stop_token_ids == stops  # [EOS] too, where the vocabulary has it
        assert tok.convert_tokens_to_ids("<|end_of_msg|>") == eom
        assert tok.convert_tokens_to_ids(["<|open|>", "<|sep|>"]) == [tok.special_tokens["<|open|>"],
                                                                      tok.special_tokens["<|sep|>"]]
        assert tok.decode(tok.encode("hello world")) == "hello world"
    assert released.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")]
    assert released.convert_tokens_to_ids("<|reserved_token_7|>") == first + 7


@pytest.mark.parametrize("which", ["released", "bundled"])
def test_marker_text_is_text_in_encode_text(which, released, bundled):
    tok = released if which == "released" else bundled
    text = "a<|close|>b<|end_of_msg|>[EOS]"
    special = set(tok.special_tokens.values())
    assert set(tok.encode(text)) & special  # Hugging Face's encode reads marker text as markers
    plain = tok.encode_text(text)
    assert not set(plain) & special and tok.decode(plain) == text


@pytest.mark.parametrize("which", ["released", "bundled"])
def test_decode_stream_pieces_add_up_with_split_characters(which, released, bundled):
    tok = released if which == "released" else bundled
    text = "héllo 日本 🙂 world<|open|>"
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some character is split across ids
    stream = tok.decode_stream(skip_special_tokens=True)
    assert "".join(stream.step(i) for i in ids) == tok.decode(ids, skip_special_tokens=True) == "héllo 日本 🙂 world"


def test_load_tokenizer_dispatch(tmp_path, bundled):
    assert isinstance(load_tokenizer(), Tokenizer)
    (tmp_path / "released").mkdir()
    write_released_style_tokenizer(tmp_path / "released")
    (tmp_path / "released" / "tokenizer.json").write_text("not read: the released files win")
    assert type(load_tokenizer(tmp_path / "released")).__name__ == "TiktokenTokenizer"
    bundled.save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), Tokenizer)
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("hi") == bundled.encode("hi")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither tiktoken.model"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="absent.json"):
        load_tokenizer(tmp_path / "absent.json")


def test_model_tokenizer_reads_what_the_checkpoint_ships(tmp_path, bundled):
    """generate, serve and bench take a model directory's own tokenizer (released files first), else the bundled one."""
    from k3.data import model_tokenizer
    released = tmp_path / "released"
    released.mkdir()
    write_released_style_tokenizer(released)
    (released / "tokenizer.json").write_text("not read: the released files win")
    assert type(model_tokenizer(released)).__name__ == "TiktokenTokenizer"
    own = tmp_path / "own"
    own.mkdir()
    backend = Tokenizer.from_file().backend
    backend.add_tokens(["<only-in-this-checkpoint>"])  # a tokenizer.json that differs from the bundled one
    backend.save(str(own / "tokenizer.json"))
    assert model_tokenizer(own).vocab_size == bundled.vocab_size + 1
    (tmp_path / "bare").mkdir()  # a checkpoint without tokenizer files: the bundled BPE
    assert model_tokenizer(tmp_path / "bare").encode("to be") == bundled.encode("to be")
