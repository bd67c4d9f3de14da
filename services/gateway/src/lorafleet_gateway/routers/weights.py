"""Weights routes: save_weights, save_weights_for_sampler, load_weights, weights_info,
save_weights_external.

load_weights has two addressing modes (tinker-api.md §6.3): on an existing model at a seq_id
(a ledger operation), or create-via-load with (session_id, model_seq_id), which creates the
registration from the checkpoint (rank and targets come from the checkpoint's run) and
answers with the controller's load operation as the future.

save_weights_external (0.38) has no ledger kind of its own yet: it is a save_state under the
reserved name "external.<name>" and answers "tinker://<run>/external_weights/<name>"; the
external_weights_urls route maps the path back. Age encryption is not supported (400).
"""

from __future__ import annotations

from fastapi import APIRouter

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, futures, views
from lorafleet_gateway.deps import Ctl, Tenant
from lorafleet_gateway.protocol import (
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    WeightsInfoRequest,
)
from lorafleet_gateway.routers.service import resolve_base_model

router = APIRouter(prefix="/api/v1", tags=["weights"])


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, tenant: Tenant, ctl: Ctl) -> dict:
    views.session_of(body.model_id)
    save = cpb.SaveStatePayload(
        name=body.path,
        ttl_seconds=body.ttl_seconds or 0,
        user_metadata=convert.metadata(body.user_metadata),
    )
    reply = await futures.submit(
        ctl, tenant, body.model_id, body.seq_id, cpb.OperationPayload(save_state=save)
    )
    return futures.submitted(reply.operation_id, body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, tenant: Tenant, ctl: Ctl
) -> dict:
    session = views.session_of(body.model_id)
    save = cpb.SaveWeightsForSamplerPayload(
        kind=body.kind,
        ttl_seconds=body.ttl_seconds or 0,
        user_metadata=convert.metadata(body.user_metadata),
    )
    if body.path:
        save.name = body.path
    elif body.sampling_session_seq_id is not None:
        save.sampler_session_id = views.sampler_id(session, body.sampling_session_seq_id)
        save.sampling_session_seq_id = body.sampling_session_seq_id
    else:
        raise errors.InvalidArgument(
            "give a path (named save) or a sampling_session_seq_id (ephemeral save)",
            field="path",
        )
    payload = cpb.OperationPayload(save_weights_for_sampler=save)
    reply = await futures.submit(ctl, tenant, body.model_id, body.seq_id, payload)
    return futures.submitted(reply.operation_id, body.model_id)


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsExternalRequest, tenant: Tenant, ctl: Ctl) -> dict:
    if body.age_encryption_recipients:
        raise errors.InvalidArgument(
            "age encryption is not supported by this server; omit the recipients",
            field="age_encryption_recipients",
        )
    views.session_of(body.model_id)
    save = cpb.SaveStatePayload(
        name=views.EXTERNAL_PREFIX + body.path, ttl_seconds=body.ttl_seconds or 0
    )
    reply = await futures.submit(
        ctl, tenant, body.model_id, body.seq_id, cpb.OperationPayload(save_state=save)
    )
    request_id = f"{futures.EXTERNAL}{body.path}:{reply.operation_id}"
    return futures.submitted(request_id, body.model_id)


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, tenant: Tenant, ctl: Ctl) -> dict:
    path = views.controller_path(views.check_tinker_path(body.path))
    if body.model_id is not None and body.seq_id is not None:
        views.session_of(body.model_id)
        load = cpb.LoadStatePayload(path=path, with_optimizer=body.optimizer)
        reply = await futures.submit(
            ctl, tenant, body.model_id, body.seq_id, cpb.OperationPayload(load_state=load)
        )
        return futures.submitted(reply.operation_id, body.model_id)
    if body.session_id is None or body.model_seq_id is None:
        raise errors.InvalidArgument(
            "give model_id + seq_id, or session_id + model_seq_id", field="model_id"
        )
    checkpoint = await _checkpoint(ctl, tenant, path)
    if body.base_model and await resolve_base_model(ctl, body.base_model) != checkpoint.base_model:
        raise errors.InvalidArgument(
            f"checkpoint was trained on {checkpoint.base_model!r}", field="base_model"
        )
    request = cpb.CreateRegistrationRequest(
        tenant=tenant,
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        base_model=checkpoint.base_model,
        lora_config=checkpoint.lora_config,
        user_metadata=convert.metadata(body.user_metadata),
        initial_checkpoint=path,
        initial_with_optimizer=body.optimizer,
        optimizer="adamw",
    )
    reply = await ctl.call("CreateRegistration", request)
    model_id = reply.registration.registration_id
    request_id = reply.load_operation_id or futures.CREATE + model_id
    return futures.submitted(request_id, model_id)


async def _checkpoint(ctl: Ctl, tenant: str, path: str) -> cpb.Checkpoint:
    request = cpb.GetCheckpointRequest(tenant=tenant, tinker_path=path)
    return (await ctl.call("GetCheckpoint", request)).checkpoint


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, tenant: Tenant, ctl: Ctl) -> dict:
    path = views.check_tinker_path(body.tinker_path, "tinker_path")
    cp = await _checkpoint(ctl, tenant, views.controller_path(path))
    return {
        "base_model": cp.base_model,
        "is_lora": True,
        **views.lora_fields(cp.lora_config),
        "optimizer_config": {"type": "adamw"},
    }
