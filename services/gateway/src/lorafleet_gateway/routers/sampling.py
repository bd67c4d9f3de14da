"""Sampling routes: create_sampling_session, samplers/{id}, asample.

Sampler ids follow Tinker's "<session>:sample:<n>" convention and are created by the
controller (idempotent on (session, n)). asample is admitted by the controller before the
sample's identity is consumed, so overload is a plain 429 + Retry-After, which the SDK
treats as "back off and resubmit" (tinker-api.md §4).
"""

from __future__ import annotations

from fastapi import APIRouter

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, futures, views
from lorafleet_gateway.deps import Ctl, Tenant
from lorafleet_gateway.protocol import CreateSamplingSessionRequest, SampleRequest
from lorafleet_gateway.routers.service import resolve_base_model

router = APIRouter(prefix="/api/v1", tags=["sampling"])


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, tenant: Tenant, ctl: Ctl
) -> dict:
    if bool(body.model_path) == bool(body.base_model):
        raise errors.InvalidArgument(
            "give exactly one of model_path and base_model", field="model_path"
        )
    request = cpb.CreateSamplerRequest(
        tenant=tenant,
        session_id=body.session_id,
        sampling_session_seq_id=body.sampling_session_seq_id,
        base_model=await resolve_base_model(ctl, body.base_model, "sampleable")
        if body.base_model
        else "",
    )
    if body.model_path:
        path = views.check_tinker_path(body.model_path, "model_path")
        request.model_path = views.controller_path(path)
    sampler = (await ctl.call("CreateSampler", request)).sampler
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.GetSamplerRequest(tenant=tenant, sampler_id=sampling_session_id)
    sampler = (await ctl.call("GetSampler", request)).sampler
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path or None,
    }


@router.post("/asample")
async def asample(body: SampleRequest, tenant: Tenant, ctl: Ctl) -> dict:
    if not body.sampling_session_id:
        raise errors.InvalidArgument(
            "this server samples through sampling sessions; create one first",
            field="sampling_session_id",
        )
    tokens = convert.tokens_from_json(body.prompt, "prompt")
    request = cpb.SubmitSampleRequest(
        tenant=tenant,
        sampler_id=body.sampling_session_id,
        seq_id=body.seq_id or 0,
        prompt_tokens=tokens,
        params=convert.sampling_params_from_json(body.sampling_params),
        num_samples=body.num_samples,
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt_logprobs=body.topk_prompt_logprobs,
    )
    reply = await ctl.call("SubmitSample", request)
    ids = list(reply.sequence_ids) or [f"{reply.operation_id}:{i}" for i in range(body.num_samples)]
    return futures.submitted(reply.operation_id, sample_sequence_ids=ids)
