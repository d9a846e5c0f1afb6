"""k3's byte-level BPE tokenizer (Hugging Face `tokenizers`), with K3's special tokens at ids 0..9, and the surface
it shares with the released tiktoken tokenizer (`ChatTokenizerMixin`; `load_tokenizer` picks either).

Byte-level means every string, in any script, encodes and decodes back byte for byte; the special
tokens are single ids and are never produced by ordinary bytes except when their exact text appears
(and, through `encode_text` and the chat template, not even then).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer

from k3.data.chat_template import parts_to_ids, parts_to_text, render_parts
from k3.data.corpus import ASSETS_DIR

DEFAULT_TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
CHAT_TEMPLATE_JINJA = ASSETS_DIR / "chat_template.jinja"
VOCAB_SIZE = 8192
# Order is the id order: <|bos|> = 0, <|end_of_msg|> = 1 (EOS), <|pad|> = 2, then the chat/media markup.
SPECIAL_TOKENS = (
    "<|bos|>", "<|end_of_msg|>", "<|pad|>", "<|open|>", "<|close|>", "<|sep|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
)
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]
END_OF_TURN_TOKEN = "<|end_of_msg|>"  # config.json's eos_token_id: a chat turn ends here
DOCUMENT_END_TOKEN = "[EOS]"  # the released vocabulary's document end (the bundled BPE ends documents with <|end_of_msg|>)

# Where long texts may be cut before encoding without changing the result: between "X\n" and "Y" with X
# and Y not whitespace. The GPT-2 split pattern of the ByteLevel pre-tokeniser always ends a piece
# there (the lone "\n" is its own piece) and has no look-behind, so pieces on both sides are unchanged.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_CHUNK_CHARS = 4096


class TokenizerError(ValueError):
    """The tokenizer file exists but is not a usable k3 tokenizer."""


class ChatTokenizerMixin:
    """The Hugging Face-shaped surface shared by k3's tokenizers (the bundled BPE and the released tiktoken files).

    A tokenizer provides `special_tokens` ({text: id}), `bos_id`, `pad_id`, `encode` (special-token text becomes
    its id, as in Hugging Face), `encode_text` (never: text is text), `decode`, `decode_stream` and `token_to_id`.
    """

    @property
    def eos_token_id(self) -> int:
        """`<|end_of_msg|>`, where a chat turn ends: config.json's eos_token_id."""
        return self.special_tokens[END_OF_TURN_TOKEN]

    @property
    def bos_token_id(self) -> int | None:
        return self.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.pad_id

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: the end of a turn and, where the vocabulary has it, `[EOS]` (document end)."""
        names = (END_OF_TURN_TOKEN, DOCUMENT_END_TOKEN)
        return sorted({self.special_tokens[t] for t in names if t in self.special_tokens})

    def convert_tokens_to_ids(self, tokens):
        """Id of a token (a special token's text or a vocabulary entry), or a list of ids for a list."""
        if isinstance(tokens, str):
            return self.special_tokens[tokens] if tokens in self.special_tokens else self.token_to_id(tokens)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = False, tokenize: bool = True,
                            thinking: bool = True, thinking_effort=None, tool_choice=None, response_format=None,
                            return_dict: bool = False, media=None):
        """OpenAI-format messages in K3's XTML markup (SPEC §1.2): the exact string (tokenize=False), or its ids,
        in which only the renderer's markers are special ids; return_dict gives {"input_ids", "attention_mask"}.
        Raises ValueError naming the bad field."""
        parts, _ = render_parts(messages, tools=tools, add_generation_prompt=add_generation_prompt, thinking=thinking,
                                thinking_effort=thinking_effort, tool_choice=tool_choice,
                                response_format=response_format, media=media)
        if not tokenize:
            return parts_to_text(parts, self)
        ids = parts_to_ids(parts, self)[0]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


class Tokenizer(ChatTokenizerMixin):
    """Thin wrapper over a `tokenizers.Tokenizer` that knows k3's special tokens."""

    def __init__(self, backend: HFTokenizer, source: str = "<in memory>"):
        self._backend = backend
        # A twin that splits special-token text like any text: what encode_text uses for user-supplied text.
        self._text_backend = HFTokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        self._source = source
        specials = {}
        for name in SPECIAL_TOKENS:
            token_id = backend.token_to_id(name)
            if token_id is None:
                raise TokenizerError(f"tokenizer {source} lacks the special token {name!r}")
            specials[name] = token_id
        self._special_tokens = specials
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path | None = None) -> "Tokenizer":
        """Load a `tokenizer.json`; path defaults to the bundled one.

        Raises FileNotFoundError if missing, TokenizerError (a ValueError) if unreadable or not k3's.
        """
        path = Path(DEFAULT_TOKENIZER_PATH if path is None else path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for any parse failure
            raise TokenizerError(f"tokenizer file {path} could not be parsed: {err}") from err
        return cls(backend, source=str(path))

    def save_pretrained(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` naming the tokenizer class and its special tokens,
        so that Hugging Face transformers (AutoTokenizer) and llama.cpp's converter load the directory as it is."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for t, i in self._special_tokens.items()}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)],
            "added_tokens_decoder": added,
            "add_bos_token": False, "add_eos_token": False,  # the chat markup adds no BOS (SPEC §1.2)
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1048576,
            # the XTML markup for tools that render chats through Jinja (transformers, llama.cpp)
            "chat_template": CHAT_TEMPLATE_JINJA.read_text(),
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # --- vocabulary -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._special_tokens[BOS_TOKEN]

    @property
    def eos_id(self) -> int:
        return self._special_tokens[EOS_TOKEN]

    @property
    def pad_id(self) -> int:
        return self._special_tokens[PAD_TOKEN]

    @property
    def special_tokens(self) -> dict[str, int]:
        """{token text: id} for the ten special tokens, in id order."""
        return dict(self._special_tokens)

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for `decoders.DecodeStream`)."""
        return self._backend

    def token_to_id(self, token: str) -> int:
        """Id of a vocabulary entry (in byte-level form); KeyError if it is not in the vocabulary."""
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        self._check_ids([token_id])
        return self._backend.id_to_token(token_id)

    # --- text <-> ids -----------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`; optionally framed by <|bos|> / <|end_of_msg|>."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """`encode` for many texts at once.

        Long texts are cut at safe line breaks (see _SAFE_CUT) and all pieces go through the Rust
        backend in one parallel batch: whole books encode several times faster, with identical ids.
        """
        texts = list(texts)
        pieces: list[str] = []
        counts: list[int] = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be str, got {type(text).__name__}")
            text_pieces = _cut_at_safe_points(text, _CHUNK_CHARS)
            pieces.extend(text_pieces)
            counts.append(len(text_pieces))
        # encode_batch_fast skips offset tracking, which k3 never uses.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        encodings = encode(pieces, add_special_tokens=False)
        results, cursor = [], 0
        for count in counts:
            ids = [token_id for e in encodings[cursor:cursor + count] for token_id in e.ids]
            results.append(self._frame(ids, add_bos, add_eos))
            cursor += count
        return results

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: a special token's spelling is encoded like any other text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        encode = getattr(self._text_backend, "encode_batch_fast", self._text_backend.encode_batch)
        return [i for e in encode(_cut_at_safe_points(text, _CHUNK_CHARS), add_special_tokens=False) for i in e.ids]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (a list, or any iterable of ints such as a 1-D tensor)."""
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        """A decoder that turns ids, fed one at a time, into text pieces (see StreamDecoder)."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _frame(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(ids) + ([self.eos_id] if add_eos else [])

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self._vocab_size}), got {bad[:5]}")


def load_tokenizer(path: str | Path | None = None):
    """k3's one way in to a tokenizer: None → the bundled BPE; a `tokenizer.json` file, or a directory holding the
    released `tiktoken.model` + `tokenizer_config.json` (preferred when both are there) or a `tokenizer.json`.
    Both kinds have the same surface (ChatTokenizerMixin): encode, decode, apply_chat_template, eos_token_id, …"""
    if path is None:
        return Tokenizer.from_file()
    path = Path(path)
    if path.is_dir():
        from k3.data.tiktoken_loader import has_tiktoken_files, load_tiktoken_tokenizer
        if has_tiktoken_files(path):
            return load_tiktoken_tokenizer(path)
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_file(path / "tokenizer.json")
        raise FileNotFoundError(f"tokenizer directory {path} has neither tiktoken.model + tokenizer_config.json "
                                f"nor tokenizer.json")
    return Tokenizer.from_file(path)


def model_tokenizer(model_dir: str | Path):
    """The tokenizer a model directory ships (the released tiktoken files, else k3's tokenizer.json), else the
    bundled BPE: what generate, serve and bench read beside a checkpoint."""
    from k3.data.tiktoken_loader import has_tiktoken_files
    d = Path(model_dir)
    return load_tokenizer(d if has_tiktoken_files(d) or (d / "tokenizer.json").is_file() else None)


def _cut_at_safe_points(text: str, chunk_chars: int) -> list[str]:
    """Split text into pieces of about chunk_chars (or more), cutting only at _SAFE_CUT points."""
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


class StreamDecoder:
    """Incremental decoding for streaming generation.

    `step(id)` returns the new text that id completes, or "" while a multi-byte character is still
    split across tokens; concatenating every piece gives exactly `tokenizer.decode(all ids)`.
    Uses `tokenizers.decoders.DecodeStream` when the installed library has it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, use_library: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        library_stream = None
        if use_library:
            try:
                from tokenizers.decoders import DecodeStream
                library_stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            except ImportError:
                library_stream = None
        self._library_stream = library_stream
        # Fallback state: ids whose text has not been emitted yet.
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        token_id = int(token_id)
        self._tokenizer._check_ids([token_id])
        if self._library_stream is not None:
            piece = self._library_stream.step(self._tokenizer.backend, token_id)
            return piece or ""
        # Fallback: decode the pending window; a trailing U+FFFD means an incomplete UTF-8 sequence.
        self._pending.append(token_id)
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        # Byte-level tokens never merge across a complete character, so later ids cannot change
        # this text: emit it and start a fresh window.
        self._pending = []
        return text
