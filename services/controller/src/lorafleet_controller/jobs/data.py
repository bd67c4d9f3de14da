"""A job's data as users send it: Q&A pairs (juno's `{"Q": str, "A": str}` array) and
documents, checked whole before a job exists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.errors import InvalidArgument

MAX_ITEMS = 100_000


@dataclass(frozen=True)
class Pair:
    question: str
    answer: str


def parse_pairs(value: object, field: str = "pairs") -> list[Pair]:
    """A JSON array of {"Q": str, "A": str} objects → pairs; anything else is refused with
    the offending element named (`pairs[2].A`)."""
    if not isinstance(value, list):
        raise InvalidArgument('must be a JSON array of {"Q": ..., "A": ...} objects', field=field)
    if not value:
        raise InvalidArgument("must hold at least one Q&A pair", field=field)
    if len(value) > MAX_ITEMS:
        raise InvalidArgument(f"at most {MAX_ITEMS} pairs", field=field)
    pairs = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument('must be an object {"Q": ..., "A": ...}', field=where)
        unknown = sorted(set(item) - {"Q", "A"})
        if unknown:
            raise InvalidArgument(f"unknown key {unknown[0]!r} (expected Q and A)", field=where)
        for key in ("Q", "A"):
            if key not in item:
                raise InvalidArgument(f"missing key {key!r}", field=f"{where}.{key}")
            text = item[key]
            if not isinstance(text, str):
                raise InvalidArgument(
                    f"must be a string, got {type(text).__name__}", field=f"{where}.{key}"
                )
            if not text.strip():
                raise InvalidArgument("must not be empty", field=f"{where}.{key}")
        pairs.append(Pair(item["Q"], item["A"]))
    return pairs


def check_pairs(pairs: Sequence[Pair], field: str = "pairs") -> None:
    """Pairs that arrived as typed messages: the same rules as `parse_pairs`."""
    parse_pairs([{"Q": p.question, "A": p.answer} for p in pairs], field)


def check_documents(documents: Sequence[str], field: str = "documents") -> None:
    if not documents:
        raise InvalidArgument("must hold at least one document", field=field)
    if len(documents) > MAX_ITEMS:
        raise InvalidArgument(f"at most {MAX_ITEMS} documents", field=field)
    for i, doc in enumerate(documents):
        if not doc.strip():
            raise InvalidArgument("must not be empty", field=f"{field}[{i}]")
