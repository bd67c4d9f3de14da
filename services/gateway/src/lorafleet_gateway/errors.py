"""Domain errors and failed controller calls → Tinker-shaped HTTP errors.

The SDK treats status codes as its retry policy (tinker-api.md §4): 408/409/429/5xx are
retried, other 4xx are fatal. So a conflict (same seq_id, different payload) is 422, never
409, which the SDK would retry forever; backpressure is 429 with Retry-After; an expired
result is 410. The body is FastAPI-like JSON ({"detail": "field: message", ...}); the SDK
only embeds it in its exception message, so the field name reaches the user.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet import errors
from lorafleet_gateway.auth import tenant_of

log = logging.getLogger(__name__)

_STATUS: dict[type[errors.LorafleetError], int] = {
    errors.InvalidArgument: 400,
    errors.FailedPrecondition: 400,
    errors.PermissionDenied: 401,
    errors.NotFound: 404,
    errors.Expired: 410,
    errors.Conflict: 422,
    errors.AlreadyExists: 422,
    errors.ResourceExhausted: 429,
    errors.Internal: 500,
    errors.Unavailable: 503,
}


class PayloadTooLarge(errors.InvalidArgument):
    """A body over max_body_bytes (413)."""


def status_for(exc: errors.LorafleetError) -> int:
    if isinstance(exc, PayloadTooLarge):
        return 413
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


def error_response(exc: errors.LorafleetError, status: int | None = None) -> JSONResponse:
    status = status or status_for(exc)
    body = {
        "detail": str(exc),
        "field": exc.field or None,
        "reason": exc.reason or type(exc).__name__,
        "category": exc.category,
    }
    headers = {}
    if isinstance(exc, errors.ResourceExhausted):
        # The SDK prefers retry-after-ms; Retry-After must be whole seconds.
        headers["retry-after-ms"] = str(max(1, round(exc.retry_after * 1000)))
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(body, status_code=status, headers=headers)


def dotted(loc: Sequence[object]) -> str:
    """("body", "data", 0, "loss_fn_inputs") → "data[0].loss_fn_inputs"."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def sent_field(error: Mapping[str, Any], body: object) -> str:
    """A pydantic error's place in `body` (its loc is relative to it), named as the client's
    JSON names it. Pydantic puts the union member it tried into loc ("str", "list[int]",
    "int": `sampling_params.stop.str`), which is no field the client sent, so a part the
    body does not have is dropped, unless it is the missing field itself."""
    loc = list(error.get("loc", ()))
    missing = error.get("type") == "missing"
    node, kept = body, []
    for i, part in enumerate(loc):
        sent = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if sent:
            node = node[part]  # type: ignore[index]
        elif not (missing and i == len(loc) - 1):
            continue
        kept.append(part)
    return dotted(kept) or "body"


def validation_error(exc: RequestValidationError) -> errors.InvalidArgument:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # loc is ("body", <character offset>)
        where = first.get("loc", ("body", "?"))[-1]
        return errors.InvalidArgument(f"malformed JSON at character {where}", field="body")
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):
        field = sent_field({**first, "loc": loc[1:]}, exc.body)
    else:  # a query or path parameter
        field = dotted(loc) or "body"
    return errors.InvalidArgument(str(first.get("msg", "invalid")), field=field)


async def _spend_named_seq_id(request: Request, body: object, error: errors.LorafleetError) -> None:
    """A body refused by its schema that still names (model_id, seq_id) spends that seq_id,
    as the SDK already has: otherwise the run's next operation waits for the gap timeout."""
    if not isinstance(body, dict) or "seq_id" not in body:
        return
    try:
        tenant = await tenant_of(request)
    except errors.LorafleetError:
        return
    await request.app.state.serving.ledger.spend_named(tenant, body, error)


def install(app: FastAPI) -> None:
    """Register the handlers that give every failure a JSON body and a meaningful status."""

    @app.exception_handler(errors.LorafleetError)
    async def _domain(_: Request, exc: errors.LorafleetError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        await _spend_named_seq_id(request, exc.body, error)
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's only 400 of its own: a body its parser gave up on (too deep, say)
        field = "body" if exc.status_code == 400 else None
        body = {"detail": exc.detail, "field": field, "reason": "HTTP", "category": "user"}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(errors.Internal(f"{type(exc).__name__}: {exc}"))
