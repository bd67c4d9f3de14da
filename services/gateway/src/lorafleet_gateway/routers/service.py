"""Bootstrap routes: client/config, client/dynamic_config, capabilities, health."""

from __future__ import annotations

from fastapi import APIRouter

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    ClientConfigRequest,
    ClientConfigResponse,
    DynamicConfigResponse,
    Health,
    ServerCapabilities,
)

router = APIRouter(prefix="/api/v1", tags=["service"])


@router.post(
    "/client/config", response_model=ClientConfigResponse, response_model_exclude_none=True
)
async def client_config(
    serving: Areas, body: ClientConfigRequest | None = None
) -> ClientConfigResponse:
    return serving.service.client_config()


@router.post("/client/dynamic_config")
async def dynamic_config(
    serving: Areas, body: ClientConfigRequest | None = None
) -> DynamicConfigResponse:
    return serving.service.dynamic_config()


@router.get("/get_server_capabilities")
async def get_server_capabilities(tenant: Tenant, serving: Areas) -> ServerCapabilities:
    return await serving.service.capabilities()


@router.get("/healthz")
async def healthz() -> Health:
    return Health()
