"""The released tokenizer: a tiktoken BPE (`tiktoken.model`: one `base64(token bytes) rank` a line) plus the
special tokens that `tokenizer_config.json` declares in `added_tokens_decoder` (SPEC §1.2)."""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Sequence

from k3.data.tokenizer import ChatTokenizerMixin, TokenizerError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
# The released pre-tokenisation split (SPEC §1.2), which the files do not ship: Han runs on their own; other
# letter runs split at case changes (CamelCase) and keep an English contraction suffix ("it's" is one piece);
# digit groups of at most 3; punctuation runs; newlines; other whitespace. `&&` is class intersection (tiktoken's
# Rust regex). A "pat_str" entry in tokenizer_config.json overrides it.
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
DEFAULT_PATTERN = KIMI_PATTERN


class TiktokenTokenizerError(TokenizerError):
    """A tokenizer directory is missing a file or declares something inconsistent."""


def has_tiktoken_files(path) -> bool:
    p = Path(path)
    return (p / TIKTOKEN_FILE).is_file() and (p / CONFIG_FILE).is_file()


class TiktokenTokenizer(ChatTokenizerMixin):
    """encode/decode through `tiktoken.Encoding`; ids and special tokens exactly as the files declare them."""

    def __init__(self, encoding, specials: dict[str, int], bos: str | None, eos: str | None, pad: str | None):
        self.encoding = encoding
        self.special_tokens = dict(specials)
        self._special_ids = set(specials.values())
        self.bos_id = specials.get(bos) if bos else None
        self.eos_id = specials.get(eos) if eos else None
        self.pad_id = specials.get(pad) if pad else None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, allow_special: bool = True) -> list[int]:
        """Text → ids. allow_special: special-token strings in the text become their ids (else they are
        encoded as ordinary text)."""
        ids = self.encoding.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids + (
            [self.eos_id] if add_eos and self.eos_id is not None else [])

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: a special token's spelling is encoded like any other text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = self._checked(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.encoding.decode(ids)

    def decode_stream(self, skip_special_tokens: bool = False) -> "ByteStreamDecoder":
        """A decoder that turns ids, fed one at a time, into text pieces (as the bundled tokenizer's)."""
        return ByteStreamDecoder(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(self._checked([token_id])[0])

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TiktokenTokenizerError(f"ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.encoding.encode_single_token(token.encode("utf-8"))


class ByteStreamDecoder:
    """`step(id)` → the text that id completes ("" while a UTF-8 character is split across tokens); the pieces
    concatenate to `decode(all ids)`, invalid bytes included (both replace them with U+FFFD)."""

    def __init__(self, tokenizer: TiktokenTokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._skip and token_id in self._tokenizer._special_ids:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))


def _token_name(v) -> str | None:
    """tokenizer_config.json writes bos/eos/pad either as a string or as {"content": ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def load_tiktoken_tokenizer(path) -> TiktokenTokenizer:
    """Loads `tiktoken.model` + `tokenizer_config.json` from the directory `path` through the tiktoken library.

    Special tokens are the `added_tokens_decoder` entries (id → {"content": ...}); bos/eos/pad come from
    `bos_token`, `eos_token`, `pad_token`. Raises TiktokenTokenizerError for missing files, an id that collides
    with a BPE rank, or a bos/eos/pad that names no declared special token."""
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError:
        raise TiktokenTokenizerError("the tiktoken package is needed for tiktoken.model tokenizers (pip install tiktoken)") from None
    p = Path(path)
    for f in (TIKTOKEN_FILE, CONFIG_FILE):
        if not (p / f).is_file():
            raise TiktokenTokenizerError(f"{p}: no {f} (a tiktoken tokenizer needs {TIKTOKEN_FILE} and {CONFIG_FILE})")
    try:
        ranks = load_tiktoken_bpe(str(p / TIKTOKEN_FILE))
    except Exception as e:  # tiktoken raises plain ValueError/binascii errors for malformed lines
        raise TiktokenTokenizerError(f"{p / TIKTOKEN_FILE} is not a tiktoken BPE file: {e}") from None
    try:
        cfg = json.loads((p / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise TiktokenTokenizerError(f"{p / CONFIG_FILE} is not valid JSON: {e}") from None
    specials = {}
    for sid, entry in (cfg.get("added_tokens_decoder") or {}).items():
        content = _token_name(entry)
        if content is None or not str(sid).isdigit():
            raise TiktokenTokenizerError(f"{p / CONFIG_FILE}: bad added_tokens_decoder entry {sid!r}: {entry!r}")
        if int(sid) < len(ranks):
            raise TiktokenTokenizerError(f"{p / CONFIG_FILE}: special token {content!r} has id {sid}, which is a "
                                         f"BPE rank (the BPE has {len(ranks)} tokens)")
        specials[content] = int(sid)
    names = {k: _token_name(cfg.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
    for k, v in names.items():
        if v is not None and v not in specials:
            raise TiktokenTokenizerError(f"{p / CONFIG_FILE}: {k}_token {v!r} is not among the declared special tokens")
    enc = tiktoken.Encoding(name=p.name or "k3", pat_str=cfg.get("pat_str", DEFAULT_PATTERN),
                            mergeable_ranks=ranks, special_tokens=specials)
    return TiktokenTokenizer(enc, specials, names["bos"], names["eos"], names["pad"])
