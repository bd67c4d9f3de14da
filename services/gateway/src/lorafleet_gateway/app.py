"""The gateway application: build_app(settings) → a FastAPI app serving Tinker's REST API.

Stateless by design: the lifespan opens one gRPC channel to the controller and that is all
the state there is (plus a few-second auth cache and the download-URL signer), so any number
of replicas can run behind a load balancer. Prometheus metrics are served at /metrics on the
same port; unknown routes answer 404 JSON.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lorafleet_gateway import errors, protocol
from lorafleet_gateway.auth import AuthCache
from lorafleet_gateway.controller import Controller
from lorafleet_gateway.middleware import GatewayMiddleware
from lorafleet_gateway.routers import (
    checkpoints,
    futures,
    sampling,
    service,
    sessions,
    training,
    weights,
)
from lorafleet_gateway.settings import GatewaySettings
from lorafleet_gateway.signing import Signer

ROUTERS = (service, sessions, training, futures, weights, sampling, checkpoints)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, plus the JSON schema of forward_backward's body: that route reads
    its body itself (JSON or protobuf), so FastAPI cannot infer it."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    body = protocol.ForwardBackwardRequest.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in body.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault("ForwardBackwardRequest", body)
    app.openapi_schema = schema
    return schema


def build_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.controller = Controller(settings.controller_address, settings.rpc_timeout_seconds)
        try:
            yield
        finally:
            await app.state.controller.close()

    app = FastAPI(
        title="lorafleet gateway",
        summary="The Tinker REST API (SDK 0.24.1 and 0.38.0) in front of a lorafleet controller.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.auth_cache = AuthCache(settings.auth_cache_seconds)
    secret = settings.download_secret.encode() or secrets.token_bytes(32)
    app.state.signer = Signer(secret)
    errors.install(app)
    for module in ROUTERS:
        app.include_router(module.router)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(GatewayMiddleware, max_body_bytes=settings.max_body_bytes)
    return app
