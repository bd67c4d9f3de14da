"""The lone-surrogate check (bodies.py) against a reference built on `json.loads`, and its
memory bound: it walks a body's bytes, never an object tree of them (issue 36)."""

from __future__ import annotations

import json
import re
import tracemalloc
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet_gateway.bodies import MAX_DEPTH, invalid_text_field
from lorafleet_gateway.errors import dotted

_SURROGATE = re.compile("[\ud800-\udfff]")
MIB = 1 << 20


def reference(raw: bytes) -> str | None:
    """The first field, in document order, whose text (or key) holds a lone surrogate."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None

    def walk(at: tuple[Any, ...], item: Any) -> str | None:
        if isinstance(item, str):
            return (dotted(at) or "body") if _SURROGATE.search(item) else None
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            return None
        for name, child in children:
            if isinstance(name, str) and _SURROGATE.search(name):
                return dotted((*at, name.encode("utf-8", "backslashreplace").decode()))
            found = walk((*at, name), child)
            if found is not None:
                return found
        return None

    return walk((), value)


# Characters that make escapes hard to tell apart: lone halves, pairs, backslashes, quotes,
# and the letters of a `\ud800` spelled out.
tricky = st.text(
    st.sampled_from(["a", "\\", '"', "\ud800", "\udbff", "\udc00", "\U0001f600", "u", "d", "8"]),
    max_size=8,
)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
    max_leaves=20,
)


@given(values, st.sampled_from([None, 0, 2]), st.booleans())
@settings(max_examples=500, deadline=None)
def test_names_the_field_the_reference_names(value: Any, indent: int | None, tight: bool) -> None:
    separators = (",", ":") if tight else None
    raw = json.dumps(value, indent=indent, separators=separators).encode()  # ensure_ascii
    assert invalid_text_field(raw) == reference(raw), raw


def test_keys_pairs_and_escaped_backslashes() -> None:
    cases = {
        b'{"a": {"b": [1, "\\ud800"]}}': "a.b[1]",
        b'{"a": 1, "\\udc00x": 2}': "\\udc00x",
        b'{"ok": "\\ud83d\\ude00", "text": "\\\\ud800"}': None,  # a pair; a backslash
        b'["\\ud800"': "[0]",  # refused for the surrogate before the route sees it is cut off
        b'"\\udfff"': "body",
        b"[" * (MAX_DEPTH + 1) + b'"\\ud800"': None,  # too deep: the route's parser refuses
        b'{"\xff": "\\ud800"}': None,  # not UTF-8: the route's parser refuses it
    }
    for raw, field in cases.items():
        assert invalid_text_field(raw) == field, raw


def test_a_large_body_is_walked_in_bounded_memory() -> None:
    """4 MiB of numbers with the surrogate at the end: an object tree of it (what the check
    parsed before) takes hundreds of MiB; the walk needs a few KiB."""
    body = b'{"data": [' + b",".join([b"0"] * (2 * MIB)) + b'], "x": "\\ud800"}'
    tracemalloc.start()
    try:
        assert invalid_text_field(body) == "x"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MIB, peak
