"""`POST /v1/lora/adapters/import`: a PEFT LoRA folder trained elsewhere becomes a saved
state of the caller's tenant (serving/adapters.py). Under the gateway's own /v1/lora prefix:
the Tinker API has no such route."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.lora_protocol import ImportedAdapter

router = APIRouter(prefix="/v1/lora", tags=["adapters"])
IMPORT = f"{router.prefix}/adapters/import"  # a data route: adapter files are large bodies


class ImportAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="the state's name in its new run")
    base_model: str = Field("", description="served base model (default: the adapter's)")
    files: dict[str, str] = Field(
        description="adapter_config.json and adapter_model.safetensors, base64-encoded"
    )


@router.post("/adapters/import")
async def import_adapter(body: ImportAdapterBody, tenant: Tenant, areas: Areas) -> ImportedAdapter:
    return await areas.adapters.import_peft(tenant, body.name, body.base_model, body.files)
