"""The shipped pre-training corpus: where it lives, how it splits into documents, its hash.

Documents end with `DOC_SEP` (the end-of-text token plus a newline), so the file reads as plain
text and the pre-training stream can put one end-of-text token between documents.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
DOC_SEP = "<|endoftext|>\n"


def read_corpus(path: Path = CORPUS_PATH) -> str:
    return path.read_text(encoding="utf-8")


def corpus_documents(text: str) -> list[str]:
    """The documents of a corpus text, without separators or empty trailing pieces."""
    return [doc for doc in text.split(DOC_SEP) if doc]


def corpus_sha256(path: Path = CORPUS_PATH) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
