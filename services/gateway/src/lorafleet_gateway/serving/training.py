"""Training: create_model, get_info, forward_backward, forward, optim_step, unload_model.

forward_backward arrives as JSON (0.24.1 default) or as a tinker_public protobuf body,
optionally zstd-compressed (0.38 always; 0.24.1 with proto_write_fwdbwd). Both become the
same ForwardBackwardInput and go straight to the ledger at the client's (model_id, seq_id).
LoRA options beyond Tinker's fields arrive as `lorafleet.*` keys of create_model's
user_metadata (`lorafleet.contract.split_lora_options`); the other keys are the user's.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json

import pydantic
import zstandard

from lorafleet import contract, errors, validate_msgs
from lorafleet.contract import FutureId, FutureKind
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.errors import PayloadTooLarge, sent_field
from lorafleet_gateway.protocol import (
    CreateModelRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    GetInfoResponse,
    ModelData,
    OptimizerInfo,
    OptimStepRequest,
    UntypedAPIFuture,
)
from lorafleet_gateway.serving.common import Ledger, future, model_limits, resolve_base_model
from lorafleet_gateway.settings import GatewaySettings


class TrainingServing:
    def __init__(
        self, controller: ControllerClient, ledger: Ledger, settings: GatewaySettings
    ) -> None:
        self._controller = controller
        self._ledger = ledger
        self._max_body = settings.max_body_bytes
        self._lora_defaults = settings.lora_option_defaults
        self._caps = {
            "max_rows": settings.max_rows_per_operation,
            "max_tokens": settings.max_tokens_per_operation,
        }

    async def create_model(self, tenant: str, body: CreateModelRequest) -> UntypedAPIFuture:
        if body.optimizer_config and body.optimizer_config.type not in contract.OPTIMIZERS:
            raise errors.InvalidArgument(
                f"optimizer {body.optimizer_config.type!r} is not supported "
                f"({', '.join(contract.OPTIMIZERS)} only)",
                field="optimizer_config.type",
            )
        options, user_metadata = contract.split_lora_options(
            convert.metadata(body.user_metadata), self._lora_defaults
        )
        model = await resolve_base_model(self._controller, body.base_model)
        lora = convert.lora_from_json(body.lora_config, options)
        if model is not None:  # an unknown model: the controller answers with what it serves
            contract.check_lora_config(lora, model.max_rank)
            contract.check_lora_targets(options, model.modules)
        request = cpb.CreateRegistrationRequest(
            tenant=tenant,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=model.name if model else body.base_model,
            lora_config=lora,
            user_metadata=user_metadata,
            optimizer=contract.OPTIMIZERS[0],
        )
        reg = (await self._controller.create_registration(request)).registration
        return future(FutureId(FutureKind.CREATE, reg.registration_id), reg.registration_id)

    async def get_info(self, tenant: str, model_id: str) -> GetInfoResponse:
        request = cpb.GetRegistrationRequest(tenant=tenant, registration_id=model_id)
        reg = (await self._controller.get_registration(request)).registration
        models = await self._controller.capabilities()
        model = next((m for m in models if m.name == reg.base_model), None)
        data = ModelData(model_name=reg.base_model)
        if model is not None:
            data = ModelData(
                model_name=reg.base_model,
                arch=model.arch or None,
                tokenizer_id=model.tokenizer_id or None,
            )
        return GetInfoResponse(
            model_id=reg.registration_id,
            model_data=data,
            lora_rank=reg.lora_config.rank,
            model_name=reg.base_model,
            optimizer_config=OptimizerInfo(type=reg.optimizer or contract.OPTIMIZERS[0]),
        )

    async def forward_backward(
        self, tenant: str, raw: bytes, protobuf: bool, zstd: bool
    ) -> UntypedAPIFuture:
        """A JSON or tinker_public protobuf body, optionally zstd-compressed."""
        if zstd:
            raw = self._decompress(raw)
        if protobuf:
            model_id, seq_id, convert_input = convert.fb_request_parts_from_proto(raw)
        else:
            body = await self._parse_json(tenant, raw)
            model_id, seq_id = body.model_id, body.seq_id
            convert_input = functools.partial(
                convert.fb_input_from_json,
                body.forward_backward_input,
                "forward_backward_input",
                False,
            )
        limits = await self._limits(tenant, model_id)

        def payload() -> cpb.OperationPayload:
            fb = convert_input(limits)
            if fb.forward_only:
                return cpb.OperationPayload(forward=fb)
            return cpb.OperationPayload(forward_backward=fb)

        return await self._ledger.admit(tenant, model_id, seq_id, payload)

    async def forward(self, tenant: str, body: ForwardRequest) -> UntypedAPIFuture:
        limits = await self._limits(tenant, body.model_id)

        def payload() -> cpb.OperationPayload:
            fb = convert.fb_input_from_json(body.forward_input, "forward_input", True, limits)
            return cpb.OperationPayload(forward=fb)

        return await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)

    async def _limits(self, tenant: str, model_id: str) -> validate_msgs.Limits:
        """What the run's base model accepts (vocabulary, context length), from capabilities,
        so a token id or a datum the trainer would refuse is a 400 before it is admitted, and
        this gateway's caps on one operation's rows and tokens. An unknown run or model gives
        no model limits here; the ledger or the trainer answers it."""
        request = cpb.GetRegistrationRequest(tenant=tenant, registration_id=model_id)
        try:
            base_model = (await self._controller.get_registration(request)).registration.base_model
        except errors.LorafleetError:
            return dataclasses.replace(validate_msgs.UNKNOWN, **self._caps)
        return dataclasses.replace(await model_limits(self._controller, base_model), **self._caps)

    async def optim_step(self, tenant: str, body: OptimStepRequest) -> UntypedAPIFuture:
        def payload() -> cpb.OperationPayload:
            if body.optimizer_params is not None and body.adam_params is None:
                raise errors.InvalidArgument(
                    "only adam_params (AdamW) is supported", field="optimizer_params"
                )
            return cpb.OperationPayload(optim_step=convert.adam_from_json(body.adam_params))

        return await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)

    async def unload_model(self, tenant: str, model_id: str) -> UntypedAPIFuture:
        request = cpb.DeleteRegistrationRequest(tenant=tenant, registration_id=model_id)
        await self._controller.delete_registration(request)
        return future(FutureId(FutureKind.UNLOAD, model_id), model_id)

    async def _parse_json(self, tenant: str, raw: bytes) -> ForwardBackwardRequest:
        """The JSON body, or a 400 naming the field (spending the seq_id it names)."""
        try:
            return ForwardBackwardRequest.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
        try:
            named = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
            named = None
        error = errors.InvalidArgument(first["msg"], field=sent_field(first, named))
        await self._ledger.spend_named(tenant, named, error)
        raise error

    def _decompress(self, raw: bytes) -> bytes:
        limit = self._max_body
        try:
            out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read(limit + 1)
        except zstandard.ZstdError as exc:
            raise errors.InvalidArgument(f"bad zstd data: {exc}", field="body") from None
        if len(out) > limit:
            raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes", field="body")
        return out
