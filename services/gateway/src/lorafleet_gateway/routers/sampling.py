"""Sampling routes: create_sampling_session, samplers/{id}, asample."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
)
from lorafleet_gateway.routers.training import FUTURE

router = APIRouter(prefix="/api/v1", tags=["sampling"])


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, tenant: Tenant, serving: Areas
) -> CreateSamplingSessionResponse:
    return await serving.sampling.create_session(tenant, body)


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(
    sampling_session_id: str, tenant: Tenant, serving: Areas
) -> GetSamplerResponse:
    return await serving.sampling.get_sampler(tenant, sampling_session_id)


@router.post("/asample", **FUTURE)
async def asample(body: SampleRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.sampling.sample(tenant, body)
