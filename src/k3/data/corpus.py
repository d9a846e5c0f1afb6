"""The bundled corpus (Shakespeare's works, one document per work) and its train/validation split."""
from __future__ import annotations

import json
import lzma
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS_PATH = ASSETS_DIR / "shakespeare.jsonl.xz"


class CorpusError(ValueError):
    """The corpus file exists but cannot be read as xz-compressed JSON lines of {"title", "text"}."""


@dataclass(frozen=True)
class Document:
    """One whole work: its title and full text."""

    title: str
    text: str


def load_corpus(path: str | Path | None = None) -> list[Document]:
    """Read a corpus file (xz-compressed JSON lines, one {"title": str, "text": str} a line).

    path: defaults to the bundled `assets/shakespeare.jsonl.xz`.
    Raises FileNotFoundError if the file is missing and CorpusError (a ValueError) if it is corrupt.
    """
    path = Path(DEFAULT_CORPUS_PATH if path is None else path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    try:
        with lzma.open(path, "rt", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (lzma.LZMAError, EOFError) as err:
        raise CorpusError(f"corpus file {path} is not valid xz data: {err}") from err
    except UnicodeDecodeError as err:
        raise CorpusError(f"corpus file {path} is not UTF-8 text: {err}") from err

    documents: list[Document] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"corpus file {path}, line {line_number}: bad JSON ({err})") from err
        if not (isinstance(record, dict) and isinstance(record.get("title"), str)
                and isinstance(record.get("text"), str)):
            raise CorpusError(f"corpus file {path}, line {line_number}: expected an object with string "
                              f"fields 'title' and 'text'")
        documents.append(Document(title=record["title"], text=record["text"]))
    if not documents:
        raise CorpusError(f"corpus file {path} holds no documents")
    return documents


def split_documents(docs: list[Document], val_fraction: float = 0.08,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, val); deterministic in (docs, val_fraction, seed).

    The validation side gets round(len(docs) * val_fraction) documents, at least one, and the training
    side keeps at least one. Both sides keep the documents' original order.
    """
    if len(docs) < 2:
        raise ValueError(f"split_documents needs at least 2 documents, got {len(docs)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    # PCG64 streams are stable across numpy versions, so the split is too.
    order = np.random.default_rng(seed).permutation(len(docs))
    val_index = set(order[:n_val].tolist())
    train = [d for i, d in enumerate(docs) if i not in val_index]
    val = [d for i, d in enumerate(docs) if i in val_index]
    return train, val
