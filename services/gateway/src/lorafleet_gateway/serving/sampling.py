"""Sampling: create_sampling_session, samplers/{id}, asample.

Sampler ids follow Tinker's "<session>:sample:<n>" convention and are created by the
controller (idempotent on (session, n)). asample is admitted by the controller before the
sample's identity is consumed, so overload is a plain 429 + Retry-After, which the SDK
treats as "back off and resubmit" (tinker-api.md §4).
"""

from __future__ import annotations

import secrets

from lorafleet import contract, errors, validate_msgs
from lorafleet.contract import FutureId, FutureKind
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, views
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
    UntypedAPIFuture,
)
from lorafleet_gateway.serving.common import base_model_name, future, model_limits

# A sample request without a seq_id gets a fresh random one from the top half of int63, far
# above any client's counter: it is then never a "retry" of an earlier, different request
# (the controller deduplicates samples on (sampler, seq_id)).
MINTED_SEQ_BASE = 1 << 62


class SamplingServing:
    def __init__(self, controller: ControllerClient) -> None:
        self._controller = controller

    async def create_session(
        self, tenant: str, body: CreateSamplingSessionRequest
    ) -> CreateSamplingSessionResponse:
        if bool(body.model_path) == bool(body.base_model):
            raise errors.InvalidArgument(
                "give exactly one of model_path and base_model", field="model_path"
            )
        request = cpb.CreateSamplerRequest(
            tenant=tenant,
            session_id=body.session_id,
            sampling_session_seq_id=body.sampling_session_seq_id,
        )
        if body.base_model:
            request.base_model = await base_model_name(
                self._controller, body.base_model, "sampleable"
            )
        if body.model_path:
            path = contract.TinkerPath.parse(body.model_path, "model_path")
            request.model_path = views.controller_path(path)
        sampler = (await self._controller.create_sampler(request)).sampler
        return CreateSamplingSessionResponse(sampling_session_id=sampler.sampler_id)

    async def get_sampler(self, tenant: str, sampler_id: str) -> GetSamplerResponse:
        request = cpb.GetSamplerRequest(tenant=tenant, sampler_id=sampler_id)
        sampler = (await self._controller.get_sampler(request)).sampler
        return GetSamplerResponse(
            sampler_id=sampler.sampler_id,
            base_model=sampler.base_model,
            model_path=sampler.model_path or None,
        )

    async def _limits(self, tenant: str, sampler_id: str) -> validate_msgs.Limits:
        """What the sampler's base model accepts, from capabilities (cached): the rollout
        checks the same request against its own engine and settings."""
        request = cpb.GetSamplerRequest(tenant=tenant, sampler_id=sampler_id)
        base_model = (await self._controller.get_sampler(request)).sampler.base_model
        return await model_limits(self._controller, base_model)

    async def sample(self, tenant: str, body: SampleRequest) -> UntypedAPIFuture:
        if not body.sampling_session_id:
            raise errors.InvalidArgument(
                "this server samples through sampling sessions; create one first",
                field="sampling_session_id",
            )
        seq_id = body.seq_id
        if seq_id is None:
            seq_id = MINTED_SEQ_BASE + secrets.randbelow(MINTED_SEQ_BASE)
        request = cpb.SubmitSampleRequest(
            tenant=tenant,
            sampler_id=body.sampling_session_id,
            seq_id=seq_id,
            prompt_tokens=convert.tokens_from_json(body.prompt, "prompt"),
            params=convert.sampling_params_from_json(body.sampling_params),
            num_samples=body.num_samples,
            prompt_logprobs=bool(body.prompt_logprobs),
            topk_prompt_logprobs=body.topk_prompt_logprobs,
        )
        limits = await self._limits(tenant, request.sampler_id)
        convert.sdk_named(lambda: validate_msgs.check_sample(request, limits))
        reply = await self._controller.submit_sample(request)
        operation = FutureId(FutureKind.OPERATION, reply.operation_id)
        ids = list(reply.sequence_ids) or [
            f"{reply.operation_id}:{i}" for i in range(body.num_samples)
        ]
        return future(operation, sample_sequence_ids=ids)
