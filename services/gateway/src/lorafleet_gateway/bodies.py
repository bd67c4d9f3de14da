"""JSON that parses but cannot be carried on: text with lone surrogates.

JSON may spell a UTF-16 surrogate alone (`"\\ud800"`); Python's parsers accept it, pydantic
keeps it, and it fails only when a protobuf or gRPC call encodes the text as UTF-8: a 500
deep inside a handler. Every JSON request is checked here first, by a dependency of the whole
app, and refused with a 400 naming the first field that holds such text. Bodies without a
surrogate escape (all real ones) cost one scan of the bytes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from lorafleet import errors
from lorafleet_gateway.errors import dotted

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_JSON = ("application/x-protobuf", "multipart/", "application/octet-stream")


def invalid_text_field(raw: bytes) -> str | None:
    """The dotted field of the first string (or object key) holding a lone surrogate, or
    None. A body that does not parse is left to the route's own parser to refuse."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:  # iterative: a deep body must not exhaust the stack here
        at, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return dotted(at) or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    return dotted((*at, key.encode("utf-8", "backslashreplace").decode()))
                stack.append(((*at, key), child))
        elif isinstance(item, list):
            stack.extend(((*at, i), child) for i, child in reversed(list(enumerate(item))))
    return None


async def refuse_invalid_text(request: Request) -> None:
    """App-wide dependency: a JSON body with a lone surrogate is a 400 naming its field."""
    if request.method in ("GET", "HEAD") or request.headers.get("content-type", "").startswith(
        _NOT_JSON
    ):
        return
    field = invalid_text_field(await request.body())
    if field is not None:
        raise errors.InvalidArgument(
            "invalid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text",
            field=field,
        )
