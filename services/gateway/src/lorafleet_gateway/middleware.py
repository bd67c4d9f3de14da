"""ASGI middleware: request-body limit and HTTP metrics.

Every route has a body limit: `max_body_bytes` for the data routes (training data, prompts),
`max_small_body_bytes` for all others. It is enforced on the declared Content-Length (413
before reading, before authentication) and on the bytes actually received (chunked uploads),
so an oversized upload never fills memory. The
metrics label each request with its route template, resolved by the router into
scope["route"] (UNMATCHED when no route matched), and its method through method_label, so
neither ids in paths nor made-up methods become label values.
"""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorafleet_gateway.errors import PayloadTooLarge
from lorafleet_gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS, UNMATCHED, method_label


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_small_body_bytes: int,
        data_routes: frozenset[str],
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_small_body_bytes = max_small_body_bytes
        self.data_routes = data_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        data = scope.get("path", "").rstrip("/") in self.data_routes
        limit = self.max_body_bytes if data else self.max_small_body_bytes
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes", field="body")
            return message

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if declared.isdigit() and int(declared) > limit:
                await _reject_too_large(recording_send, limit)
            else:
                await self.app(scope, counted_receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", UNMATCHED)
            HTTP_REQUESTS.labels(route, method_label(scope["method"]), str(status)).inc()
            HTTP_SECONDS.labels(route).observe(time.perf_counter() - start)


async def _reject_too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        {
            "detail": f"body: request body exceeds {limit} bytes",
            "field": "body",
            "reason": "PayloadTooLarge",
            "category": "user",
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
