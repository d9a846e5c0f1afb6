"""The released tokenizer: a tiktoken BPE (`tiktoken.model`: one `base64(token bytes) rank` a line) plus the
special tokens that `tokenizer_config.json` declares in `added_tokens_decoder` (SPEC §1.2)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
# Pre-tokenisation split: letter runs (with one leading non-letter), digit groups of at most 3, punctuation
# runs, newlines, other whitespace. tokenizer_config.json may override it with a "pat_str" entry.
DEFAULT_PATTERN = (r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


class TiktokenTokenizerError(ValueError):
    """A tokenizer directory is missing a file or declares something inconsistent."""


def has_tiktoken_files(path) -> bool:
    p = Path(path)
    return (p / TIKTOKEN_FILE).is_file() and (p / CONFIG_FILE).is_file()


class TiktokenTokenizer:
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

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TiktokenTokenizerError(f"ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.encoding.decode(ids)

    def token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.encoding.encode_single_token(token.encode("utf-8"))


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
