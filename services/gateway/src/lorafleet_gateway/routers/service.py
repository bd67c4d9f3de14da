"""Bootstrap routes: client/config, client/dynamic_config, capabilities, health.

client/config tells the SDK which wire paths to use (tinker-api.md §2). With the recommended
flags 0.24.1 speaks exactly like 0.38 (protobuf forward_backward, forward via
forward_backward, create-from-checkpoint via one load_weights), so one code path serves
both; `proto_flags=false` serves {} so the JSON paths stay tested too.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway.deps import Ctl, Settings, Tenant
from lorafleet_gateway.protocol import ClientConfigRequest

router = APIRouter(prefix="/api/v1", tags=["service"])
CAPABILITIES_TTL = 5.0


@router.post("/client/config")
async def client_config(settings: Settings, body: ClientConfigRequest | None = None) -> dict:
    config: dict[str, Any] = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}
    if settings.proto_flags:
        config.update(
            proto_write_fwdbwd=True,
            fwd_via_fwdbwd=True,
            create_model_via_load_weights=True,
            proto_compress_fwdbwd=settings.compress_fwdbwd,
        )
    return config


@router.post("/client/dynamic_config")
async def dynamic_config(body: ClientConfigRequest | None = None) -> dict:
    return {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": False,
        "sample_cancel_max_batch_size": 64,
    }


async def capabilities(ctl: Ctl) -> list[cpb.BaseModelInfo]:
    """GetCapabilities, cached for a few seconds (get_info needs it on every call)."""
    cached = getattr(ctl, "_capabilities", None)
    if cached and cached[1] > time.monotonic():
        return cached[0]
    reply = await ctl.call("GetCapabilities", cpb.GetCapabilitiesRequest())
    models = list(reply.models)
    ctl._capabilities = (models, time.monotonic() + CAPABILITIES_TTL)  # type: ignore[attr-defined]
    return models


async def resolve_base_model(ctl: Ctl, name: str, need: str = "trainable") -> str:
    """The name of a served model that is `need` ("trainable" or "sampleable"); its
    tokenizer folder is accepted as an alias, because the cookbook sends
    base_model = model_name = the local tokenizer folder (tinker-api.md §11)."""
    models = [m for m in await capabilities(ctl) if getattr(m, need)]
    if any(m.name == name for m in models):
        return name
    alias = next((m.name for m in models if m.tokenizer_id and m.tokenizer_id == name), None)
    return alias or name


@router.get("/get_server_capabilities")
async def get_server_capabilities(tenant: Tenant, ctl: Ctl) -> dict:
    return {
        "supported_models": [
            {
                "model_name": m.name,
                "max_context_length": m.max_context_length or None,
                "trainable": m.trainable,
                "sampleable": m.sampleable,
            }
            for m in await capabilities(ctl)
        ]
    }


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}
