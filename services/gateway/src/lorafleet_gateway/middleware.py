"""ASGI middleware: request-body limit, the API key, and HTTP metrics, in that order.

Every route has a body limit: `max_body_bytes` for the data routes (training data, prompts),
`max_small_body_bytes` for all others. It is enforced on the declared Content-Length (413
before reading, before authentication) and on the bytes actually received (chunked uploads),
so an oversized upload never fills memory.

Then the API key of every route that needs one (auth.needs_key), from the headers alone,
before the app receives a byte of the body: an anonymous or wrong-key request is a 401 in
Tinker's shape (errors.error_response, as from a route), and the body it sent is never read
into memory (the server discards what arrives after the response). The request is resolved
to its route here, by the same routes in the same order the router tries; one that matches
no route, or only by path (a 405), goes on to the app, which answers it without reading a
body either.

The metrics label each request with its route template (UNMATCHED when no route matched),
and its method through method_label, so neither ids in paths nor made-up methods become
label values.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorafleet import errors
from lorafleet_gateway.auth import needs_key, tenant_of
from lorafleet_gateway.errors import PayloadTooLarge, error_response
from lorafleet_gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS, UNMATCHED, method_label


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_small_body_bytes: int,
        data_routes: frozenset[str],
        routes: Sequence[BaseRoute],
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_small_body_bytes = max_small_body_bytes
        self.data_routes = data_routes
        self.routes = [(route, needs_key(route)) for route in routes]

    def _route(self, scope: Scope) -> tuple[BaseRoute | None, bool]:
        """The route the router will run for this request, and whether it needs a key."""
        for route, keyed in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route, keyed
        return None, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        data = scope.get("path", "").rstrip("/") in self.data_routes
        limit = self.max_body_bytes if data else self.max_small_body_bytes
        too_large = PayloadTooLarge(f"request body exceeds {limit} bytes", field="body")
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
            return message

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        matched, keyed = self._route(scope)
        try:
            declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if declared.isdigit() and int(declared) > limit:
                await error_response(too_large)(scope, receive, recording_send)
                return
            if keyed:
                try:
                    await tenant_of(Request(scope))
                except errors.LorafleetError as exc:  # 401, or 503 without a controller
                    await error_response(exc)(scope, receive, recording_send)
                    return
            await self.app(scope, counted_receive, recording_send)
        finally:
            route = getattr(scope.get("route", matched), "path", UNMATCHED)
            HTTP_REQUESTS.labels(route, method_label(scope["method"]), str(status)).inc()
            HTTP_SECONDS.labels(route).observe(time.perf_counter() - start)
