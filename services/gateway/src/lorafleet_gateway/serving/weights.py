"""Weights: save_weights, save_weights_for_sampler, load_weights, weights_info,
save_weights_external.

load_weights has two addressing modes (tinker-api.md §6.3): on an existing model at a seq_id
(a ledger operation), or create-via-load with (session_id, model_seq_id), which creates the
registration from the checkpoint (rank and targets come from the checkpoint's run) and
answers with the controller's load operation as the future.

save_weights_external (0.38) has no ledger kind of its own yet: it is a save_state under the
reserved name "external.<name>" and answers "tinker://<run>/external_weights/<name>"; its
future id carries the name (`FutureKind.EXTERNAL`). Age encryption is not supported (400).
"""

from __future__ import annotations

from lorafleet import contract, errors, names
from lorafleet.contract import FutureId, FutureKind
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, views
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    LoadWeightsRequest,
    OptimizerInfo,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedAPIFuture,
    WeightsInfoResponse,
)
from lorafleet_gateway.serving.common import (
    Ledger,
    base_model_name,
    future,
    resolve_base_model,
)


class WeightsServing:
    def __init__(self, controller: ControllerClient, ledger: Ledger) -> None:
        self._controller = controller
        self._ledger = ledger

    async def save_weights(self, tenant: str, body: SaveWeightsRequest) -> UntypedAPIFuture:
        def payload() -> cpb.OperationPayload:
            save = cpb.SaveStatePayload(
                name=names.check_name(body.path, "path"),
                ttl_seconds=body.ttl_seconds or 0,
                user_metadata=convert.metadata(body.user_metadata),
            )
            return cpb.OperationPayload(save_state=save)

        return await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)

    async def save_weights_for_sampler(
        self, tenant: str, body: SaveWeightsForSamplerRequest
    ) -> UntypedAPIFuture:
        def payload() -> cpb.OperationPayload:
            save = cpb.SaveWeightsForSamplerPayload(
                kind=body.kind,
                ttl_seconds=body.ttl_seconds or 0,
                user_metadata=convert.metadata(body.user_metadata),
            )
            if body.path:
                save.name = names.check_name(body.path, "path")
            elif body.sampling_session_seq_id is not None:
                session = views.session_of(body.model_id)
                save.sampler_session_id = views.sampler_id(session, body.sampling_session_seq_id)
                save.sampling_session_seq_id = body.sampling_session_seq_id
            else:
                raise errors.InvalidArgument(
                    "give a path (named save) or a sampling_session_seq_id (ephemeral save)",
                    field="path",
                )
            return cpb.OperationPayload(save_weights_for_sampler=save)

        return await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)

    async def save_weights_external(
        self, tenant: str, body: SaveWeightsExternalRequest
    ) -> UntypedAPIFuture:
        def payload() -> cpb.OperationPayload:
            if body.age_encryption_recipients:
                raise errors.InvalidArgument(
                    "age encryption is not supported by this server; omit the recipients",
                    field="age_encryption_recipients",
                )
            name = views.EXTERNAL_PREFIX + names.check_name(body.path, "path")
            save = cpb.SaveStatePayload(name=name, ttl_seconds=body.ttl_seconds or 0)
            return cpb.OperationPayload(save_state=save)

        submitted = await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)
        operation = FutureId.parse(submitted.request_id)
        external = FutureId(FutureKind.EXTERNAL, operation.ref, body.path)
        return future(external, body.model_id)

    async def load_weights(self, tenant: str, body: LoadWeightsRequest) -> UntypedAPIFuture:
        if body.model_id is not None and body.seq_id is not None:

            def payload() -> cpb.OperationPayload:
                path = views.controller_path(contract.TinkerPath.parse(body.path))
                load = cpb.LoadStatePayload(path=path, with_optimizer=body.optimizer)
                return cpb.OperationPayload(load_state=load)

            return await self._ledger.admit(tenant, body.model_id, body.seq_id, payload)
        if body.session_id is None or body.model_seq_id is None:
            raise errors.InvalidArgument(
                "give model_id + seq_id, or session_id + model_seq_id", field="model_id"
            )
        path = views.controller_path(contract.TinkerPath.parse(body.path))
        options, user_metadata = contract.split_lora_options(convert.metadata(body.user_metadata))
        if options != contract.LoraOptions():
            raise errors.InvalidArgument(
                "a run created from a checkpoint takes its LoRA options from the checkpoint",
                field="user_metadata",
            )
        checkpoint = await self._checkpoint(tenant, path)
        model = await resolve_base_model(self._controller, checkpoint.base_model)
        if model is not None:  # the saved adapter must still fit what serves its model now
            contract.check_lora_config(checkpoint.lora_config, model.max_rank, "path.lora_config")
            contract.check_lora_targets(checkpoint.lora_config, model.modules, "path.lora_config.")
        if body.base_model:
            named = await base_model_name(self._controller, body.base_model)
            if named != checkpoint.base_model:
                raise errors.InvalidArgument(
                    f"checkpoint was trained on {checkpoint.base_model!r}", field="base_model"
                )
        request = cpb.CreateRegistrationRequest(
            tenant=tenant,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=checkpoint.base_model,
            lora_config=checkpoint.lora_config,
            user_metadata=user_metadata,
            initial_checkpoint=path,
            initial_with_optimizer=body.optimizer,
            optimizer=contract.OPTIMIZERS[0],
        )
        reply = await self._controller.create_registration(request)
        model_id = reply.registration.registration_id
        if reply.load_operation_id:
            return future(FutureId(FutureKind.OPERATION, reply.load_operation_id), model_id)
        return future(FutureId(FutureKind.CREATE, model_id), model_id)

    async def weights_info(self, tenant: str, tinker_path: str) -> WeightsInfoResponse:
        path = contract.TinkerPath.parse(tinker_path, "tinker_path")
        cp = await self._checkpoint(tenant, views.controller_path(path))
        lora = cp.lora_config
        return WeightsInfoResponse(
            base_model=cp.base_model,
            lora_rank=lora.rank,
            train_unembed=lora.train_unembed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            optimizer_config=OptimizerInfo(),
        )

    async def _checkpoint(self, tenant: str, path: str) -> cpb.Checkpoint:
        request = cpb.GetCheckpointRequest(tenant=tenant, tinker_path=path)
        return (await self._controller.get_checkpoint(request)).checkpoint
