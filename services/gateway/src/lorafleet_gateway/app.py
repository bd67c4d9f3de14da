"""The gateway application: build_app(settings, download_secret) → a FastAPI app serving
Tinker's REST API.

Stateless by design: the lifespan opens one gRPC channel to the controller and builds the
serving layer around it; that is all the state there is (plus a one-second auth cache), so
any number of replicas can run behind a load balancer. Unknown routes answer 404 JSON, and
so does /metrics: the public port serves no metrics (what they tell about tenants' traffic is
for operators), `__main__` serves them on the separate metrics port.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from lorafleet_gateway import errors, protocol
from lorafleet_gateway.auth import AuthCache
from lorafleet_gateway.bodies import refuse_invalid_text
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.middleware import GatewayMiddleware
from lorafleet_gateway.routers import (
    adapters,
    checkpoints,
    futures,
    jobs,
    sampling,
    service,
    sessions,
    training,
    weights,
)
from lorafleet_gateway.serving import Serving
from lorafleet_gateway.settings import GatewaySettings
from lorafleet_gateway.signing import Signer

ROUTERS = (service, sessions, training, futures, weights, sampling, checkpoints, jobs, adapters)
# Routes whose bodies carry training data or prompts; every other route takes small bodies.
DATA_ROUTES = frozenset(
    {
        "/api/v1/forward_backward",
        "/api/v1/forward",
        "/api/v1/asample",
        *jobs.DATA_ROUTES,
        adapters.IMPORT,
    }
)


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


def build_app(settings: GatewaySettings, download_secret: bytes) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        controller = ControllerClient(settings.controller_address, settings.rpc_timeout_seconds)
        app.state.serving = Serving.build(controller, settings, Signer(download_secret))
        try:
            yield
        finally:
            await controller.close()

    app = FastAPI(
        title="lorafleet gateway",
        summary="The Tinker REST API (SDK 0.24.1 and 0.38.0) in front of a lorafleet controller.",
        version="0.1.0",
        lifespan=lifespan,
        dependencies=[Depends(refuse_invalid_text)],
    )
    app.state.auth_cache = AuthCache(settings.auth_cache_seconds)
    errors.install(app)
    for module in ROUTERS:
        app.include_router(module.router)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented hook

    app.add_middleware(
        GatewayMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_small_body_bytes=settings.max_small_body_bytes,
        data_routes=DATA_ROUTES,
        routes=[route for module in ROUTERS for route in module.router.routes],
    )
    return app
