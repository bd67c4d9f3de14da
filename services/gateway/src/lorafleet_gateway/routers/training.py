"""Training routes: create_model, get_info, forward_backward, forward, optim_step, unload_model.

forward_backward arrives as JSON (0.24.1 default) or as a tinker_public protobuf body,
optionally zstd-compressed (0.38 always; 0.24.1 with proto_write_fwdbwd). Both become the
same ForwardBackwardInput and go straight to the ledger at the client's (model_id, seq_id).
"""

from __future__ import annotations

import io
from typing import Any

import pydantic
import zstandard
from fastapi import APIRouter, Request

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, futures, views
from lorafleet_gateway.deps import Ctl, Settings, Tenant
from lorafleet_gateway.errors import PayloadTooLarge, dotted
from lorafleet_gateway.protocol import (
    AdamParams,
    CreateModelRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    ModelIdRequest,
    OptimStepRequest,
)
from lorafleet_gateway.routers.service import capabilities, resolve_base_model

router = APIRouter(prefix="/api/v1", tags=["training"])

_JSON_OR_PROTO = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ForwardBackwardRequest"}},
            futures.PROTO: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/create_model")
async def create_model(body: CreateModelRequest, tenant: Tenant, ctl: Ctl) -> dict:
    if body.optimizer_config and body.optimizer_config.type != "adamw":
        raise errors.InvalidArgument(
            f"optimizer {body.optimizer_config.type!r} is not supported (adamw only)",
            field="optimizer_config.type",
        )
    request = cpb.CreateRegistrationRequest(
        tenant=tenant,
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        base_model=await resolve_base_model(ctl, body.base_model),
        lora_config=convert.lora_from_json(body.lora_config),
        user_metadata=convert.metadata(body.user_metadata),
        optimizer="adamw",
    )
    reg = (await ctl.call("CreateRegistration", request)).registration
    return futures.submitted(futures.CREATE + reg.registration_id, reg.registration_id)


@router.post("/get_info")
async def get_info(body: ModelIdRequest, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.GetRegistrationRequest(tenant=tenant, registration_id=body.model_id)
    reg = (await ctl.call("GetRegistration", request)).registration
    model = next((m for m in await capabilities(ctl) if m.name == reg.base_model), None)
    model_data: dict[str, Any] = {"model_name": reg.base_model}
    if model is not None:
        model_data.update(arch=model.arch or None, tokenizer_id=model.tokenizer_id or None)
    return {
        "type": "get_info",
        "model_id": reg.registration_id,
        "model_data": model_data,
        "is_lora": True,
        "lora_rank": reg.lora_config.rank,
        "model_name": reg.base_model,
        "optimizer_config": {"type": reg.optimizer or "adamw"},
    }


def _decompress(raw: bytes, limit: int) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read(limit + 1)
    except zstandard.ZstdError as exc:
        raise errors.InvalidArgument(f"bad zstd data: {exc}", field="body") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes", field="body")
    return out


def _parse_json(model: type[pydantic.BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise errors.InvalidArgument(first["msg"], field=dotted(first["loc"]) or "body") from None


async def _rejections_spend_seq(
    tenant: str, ctl: Any, model_id: str, seq_id: int, convert_payload: Any
) -> tuple[str, int, Any]:
    """Run the payload's conversion; when it refuses the payload, spend the seq_id in the
    ledger before answering 4xx, so the run's next operation does not wait for it."""
    try:
        return model_id, seq_id, convert_payload()
    except errors.InvalidArgument as exc:
        await futures.spend_rejected(ctl, tenant, model_id, seq_id, exc)
        raise


async def _submit_fb(tenant: str, ctl: Any, model_id: str, seq_id: int, fb: Any, kind: str) -> dict:
    views.session_of(model_id)
    payload = cpb.OperationPayload(**{kind: fb})
    reply = await futures.submit(ctl, tenant, model_id, seq_id, payload)
    return futures.submitted(reply.operation_id, model_id)


@router.post("/forward_backward", openapi_extra=_JSON_OR_PROTO)
async def forward_backward(request: Request, tenant: Tenant, ctl: Ctl, settings: Settings) -> dict:
    raw = await request.body()
    if "zstd" in request.headers.get("content-encoding", ""):
        raw = _decompress(raw, settings.max_body_bytes)
    if request.headers.get("content-type", "").startswith(futures.PROTO):
        model_id, seq_id, fb = await _rejections_spend_seq(
            tenant, ctl, *convert.fb_request_parts_from_proto(raw)
        )
    else:
        body = _parse_json(ForwardBackwardRequest, raw)
        model_id, seq_id, fb = await _rejections_spend_seq(
            tenant, ctl, body.model_id, body.seq_id,
            lambda: convert.fb_input_from_json(
                body.forward_backward_input, "forward_backward_input", False
            ),
        )  # fmt: skip
    kind = "forward" if fb.forward_only else "forward_backward"
    return await _submit_fb(tenant, ctl, model_id, seq_id, fb, kind)


@router.post("/forward")
async def forward(body: ForwardRequest, tenant: Tenant, ctl: Ctl) -> dict:
    _, _, fb = await _rejections_spend_seq(
        tenant, ctl, body.model_id, body.seq_id,
        lambda: convert.fb_input_from_json(body.forward_input, "forward_input", True),
    )  # fmt: skip
    return await _submit_fb(tenant, ctl, body.model_id, body.seq_id, fb, "forward")


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, tenant: Tenant, ctl: Ctl) -> dict:
    def adam() -> cpb.AdamParams:
        if body.optimizer_params is not None and body.adam_params is None:
            raise errors.InvalidArgument(
                "only adam_params (AdamW) is supported", field="optimizer_params"
            )
        return convert.adam_from_json(body.adam_params or AdamParams())

    _, _, params = await _rejections_spend_seq(tenant, ctl, body.model_id, body.seq_id, adam)
    views.session_of(body.model_id)
    payload = cpb.OperationPayload(optim_step=params)
    reply = await futures.submit(ctl, tenant, body.model_id, body.seq_id, payload)
    return futures.submitted(reply.operation_id, body.model_id)


@router.post("/unload_model")
async def unload_model(body: ModelIdRequest, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.DeleteRegistrationRequest(tenant=tenant, registration_id=body.model_id)
    await ctl.call("DeleteRegistration", request)
    return futures.submitted(futures.UNLOAD + body.model_id, body.model_id)
