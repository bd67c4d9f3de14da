"""Training routes: create_model, get_info, forward_backward, forward, optim_step, unload_model.

forward_backward reads its body itself (JSON or tinker_public protobuf, maybe zstd), so its
request schema is declared by hand (`_JSON_OR_PROTO`; app.py adds the JSON model).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    CreateModelRequest,
    ForwardRequest,
    GetInfoResponse,
    ModelIdRequest,
    OptimStepRequest,
    UntypedAPIFuture,
)
from lorafleet_gateway.serving.futures import PROTO

router = APIRouter(prefix="/api/v1", tags=["training"])
FUTURE: dict[str, Any] = {"response_model": UntypedAPIFuture, "response_model_exclude_none": True}

_JSON_OR_PROTO = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ForwardBackwardRequest"}},
            PROTO: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/create_model", **FUTURE)
async def create_model(body: CreateModelRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.training.create_model(tenant, body)


@router.post("/get_info")
async def get_info(body: ModelIdRequest, tenant: Tenant, serving: Areas) -> GetInfoResponse:
    return await serving.training.get_info(tenant, body.model_id)


@router.post("/forward_backward", openapi_extra=_JSON_OR_PROTO, **FUTURE)
async def forward_backward(request: Request, tenant: Tenant, serving: Areas) -> Any:
    return await serving.training.forward_backward(
        tenant,
        await request.body(),
        protobuf=request.headers.get("content-type", "").startswith(PROTO),
        zstd="zstd" in request.headers.get("content-encoding", ""),
    )


@router.post("/forward", **FUTURE)
async def forward(body: ForwardRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.training.forward(tenant, body)


@router.post("/optim_step", **FUTURE)
async def optim_step(body: OptimStepRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.training.optim_step(tenant, body)


@router.post("/unload_model", **FUTURE)
async def unload_model(body: ModelIdRequest, tenant: Tenant, serving: Areas) -> Any:
    return await serving.training.unload_model(tenant, body.model_id)
