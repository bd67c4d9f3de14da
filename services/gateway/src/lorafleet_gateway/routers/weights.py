"""Weights routes: save_weights, save_weights_for_sampler, load_weights, weights_info,
save_weights_external."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    WeightsInfoRequest,
    WeightsInfoResponse,
)
from lorafleet_gateway.routers.training import FUTURE

router = APIRouter(prefix="/api/v1", tags=["weights"])


@router.post("/save_weights", **FUTURE)
async def save_weights(body: SaveWeightsRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.weights.save_weights(tenant, body)


@router.post("/save_weights_for_sampler", **FUTURE)
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, tenant: Tenant, serving: Areas
) -> Any:
    return await serving.weights.save_weights_for_sampler(tenant, body)


@router.post("/save_weights_external", **FUTURE)
async def save_weights_external(
    body: SaveWeightsExternalRequest, tenant: Tenant, serving: Areas
) -> Any:
    return await serving.weights.save_weights_external(tenant, body)


@router.post("/load_weights", **FUTURE)
async def load_weights(body: LoadWeightsRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.weights.load_weights(tenant, body)


@router.post("/weights_info")
async def weights_info(
    body: WeightsInfoRequest, tenant: Tenant, serving: Areas
) -> WeightsInfoResponse:
    return await serving.weights.weights_info(tenant, body.tinker_path)
