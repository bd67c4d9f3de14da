"""API-key authentication: X-API-Key → tenant, via the controller's Authenticate.

Keys are never stored here; a successful lookup is remembered for `auth_cache_seconds`
(at most 1 s) under the key's SHA-256, so a revoked key stops working within a second
without a revocation channel from the controller. Missing or unknown keys are 401 in
Tinker's shape. Every router takes the tenant from `Tenant`; the key's id is left on
`request.state.key_id` for `create_session`, so revoking the key ends the sessions it opened.

A route needs a key when its handler takes the tenant (`needs_key`). The gateway's middleware
checks that key from the headers alone, before any byte of the body is received: neither
FastAPI's parsing of a typed body nor the app-wide text check ever runs for an anonymous
caller, so what one costs is bounded by the headers, not by the 64 MiB a data route accepts.
"""

from __future__ import annotations

import hashlib
import time

from fastapi import Request
from fastapi.dependencies.models import Dependant
from starlette.routing import BaseRoute

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb

HEADER = "X-API-Key"
_MAX_ENTRIES = 10_000


class AuthCache:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.entries: dict[str, tuple[str, str, float]] = {}

    def get(self, digest: str) -> tuple[str, str] | None:
        """(tenant, key_id) of a recent successful lookup."""
        hit = self.entries.get(digest)
        if hit is None or hit[2] < time.monotonic():
            return None
        return hit[0], hit[1]

    def put(self, digest: str, tenant: str, key_id: str) -> None:
        if self.ttl <= 0:
            return
        if len(self.entries) >= _MAX_ENTRIES:
            self.entries.clear()
        self.entries[digest] = (tenant, key_id, time.monotonic() + self.ttl)


def needs_key(route: BaseRoute) -> bool:
    """Whether the route's handler depends on `tenant_of`, directly or through another
    dependency: the one mark of a route that answers only to a known API key."""
    dependant: Dependant | None = getattr(route, "dependant", None)
    pending = [dependant] if dependant is not None else []
    while pending:
        current = pending.pop()
        if current.call is tenant_of:
            return True
        pending.extend(current.dependencies)
    return False


async def tenant_of(request: Request) -> str:
    """The authenticated tenant, or PermissionDenied (401). The first call of a request (the
    middleware's) asks; it leaves the answer on request.state, where the routes' dependency
    finds it."""
    known: str | None = getattr(request.state, "tenant", None)
    if known is not None:
        return known
    key = request.headers.get(HEADER, "")
    if not key:
        raise errors.PermissionDenied("missing API key", field=HEADER)
    state = request.app.state
    digest = hashlib.sha256(key.encode()).hexdigest()
    cache: AuthCache = state.auth_cache  # app.state is untyped; app.py puts it there
    hit = cache.get(digest)
    if hit is None:
        try:
            reply = await state.serving.controller.authenticate(
                cpb.AuthenticateRequest(api_key=key)
            )
        except (errors.NotFound, errors.InvalidArgument, errors.PermissionDenied):
            raise errors.PermissionDenied("invalid API key", field=HEADER) from None
        if not reply.tenant:
            raise errors.PermissionDenied("invalid API key", field=HEADER)
        hit = (reply.tenant, reply.key_id)
        cache.put(digest, *hit)
    request.state.tenant, request.state.key_id = hit
    return hit[0]
