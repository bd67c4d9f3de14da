"""JSON that parses but cannot be carried on: text with lone surrogates.

JSON may spell a UTF-16 surrogate alone (`"\\ud800"`); Python's parsers accept it, pydantic
keeps it, and it fails only when a protobuf or gRPC call encodes the text as UTF-8: a 500
deep inside a handler. Every JSON request is checked here first, by a dependency of the whole
app, and refused with a 400 naming the first field that holds such text. Bodies without a
surrogate escape (all real ones) cost one scan of the bytes.

A body with one is walked token by token over its bytes, never parsed into objects: a data
route takes 64 MiB, and the object tree of that much JSON would take gigabytes. The walk
keeps the path to where it is (one entry per open container, at most `MAX_DEPTH`) and
decodes only the strings that hold a surrogate escape, so its memory is bounded by the
nesting and the largest such string, not by the size of the body.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from lorafleet import errors
from lorafleet_gateway.errors import dotted

# Deeper than any parser behind the routes accepts (json: the recursion limit, 1000;
# pydantic: 200), so a body nested deeper is the route's to refuse, as one that does not parse.
MAX_DEPTH = 10_000

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
# A string, one bracket, or a run of anything else (numbers, literals, commas, colons).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|[^"\[\]{}]+', re.DOTALL)
_NOT_JSON = ("application/x-protobuf", "multipart/", "application/octet-stream")


def _lone_surrogate(raw: bytes, start: int, end: int) -> str | None:
    """The JSON string raw[start:end] decoded, if it holds a lone surrogate."""
    try:
        text = json.loads(raw[start:end])
    except ValueError:  # not UTF-8, or not a string after all: the route's parser refuses it
        return None
    return text if isinstance(text, str) and _SURROGATE.search(text) else None


def invalid_text_field(raw: bytes) -> str | None:
    """The dotted field of the first string (or object key) holding a lone surrogate, or
    None. A body that does not parse is left to the route's own parser to refuse."""
    escape = _SURROGATE_ESCAPE.search(raw)
    if escape is None:
        return None
    # One entry per open container: an array's current index, or an object's current key
    # (as the offsets of its token, decoded only to name a field).
    path: list[int | tuple[int, int] | None] = []
    in_object: list[bool] = []
    expect_key = False

    def field(key: str | None = None) -> str | None:
        try:
            names: list[str | int] = [
                p if isinstance(p, int) else json.loads(raw[p[0] : p[1]])
                for p in path
                if p is not None
            ]
        except ValueError:  # a key that is not UTF-8: the route's parser refuses the body
            return None
        if key is not None:
            names[-1] = key.encode("utf-8", "backslashreplace").decode()
        return dotted(names) or "body"

    for token in _TOKEN.finditer(raw):
        start, end = token.span()
        first = raw[start]
        if first == ord("{") or first == ord("["):
            if len(path) == MAX_DEPTH:
                return None
            path.append(None if first == ord("{") else 0)
            in_object.append(first == ord("{"))
            expect_key = first == ord("{")
        elif first == ord("}") or first == ord("]"):
            if not path:
                return None
            path.pop()
            in_object.pop()
            expect_key = False
            if not path:  # the body's value is complete
                return None
        elif first == ord('"'):
            key = expect_key and in_object[-1]
            if key:
                path[-1] = (start, end)
            if start < escape.start() < end:
                text = _lone_surrogate(raw, start, end)
                if text is not None:
                    return field(text) if key else field()
            expect_key = False
        elif in_object and in_object[-1]:
            comma, colon = raw.rfind(b",", start, end), raw.rfind(b":", start, end)
            if comma != colon:  # else only blanks: the same part of the object
                expect_key = comma > colon
        elif in_object:
            index = path[-1]
            assert isinstance(index, int)  # an array's entry
            path[-1] = index + raw.count(b",", start, end)
        if end > escape.start():
            escape = _SURROGATE_ESCAPE.search(raw, end)
            if escape is None:
                return None
    return None


async def refuse_invalid_text(request: Request) -> None:
    """App-wide dependency: a JSON body with a lone surrogate is a 400 naming its field.
    The walk of a body with a surrogate escape runs in a worker thread: it is linear in the
    body's tokens (seconds for a pathological 64 MiB one) and must not stall the event loop
    that serves every other request."""
    if request.method in ("GET", "HEAD") or request.headers.get("content-type", "").startswith(
        _NOT_JSON
    ):
        return
    raw = await request.body()
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    field = await run_in_threadpool(invalid_text_field, raw)
    if field is not None:
        raise errors.InvalidArgument(
            "invalid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text",
            field=field,
        )
