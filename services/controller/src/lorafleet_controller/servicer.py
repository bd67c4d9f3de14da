"""ControllerService: translates protobuf requests to controller calls and back.

No logic lives here: every method unpacks its request, calls the controller (or one of its
Redis-backed parts), and packs the answer. Failures are `lorafleet.errors` exceptions that
the shared interceptor maps to status codes; nothing here calls `context.abort`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from lorafleet import errors
from lorafleet.rpc.errors import exception_from_info
from lorafleet.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from lorafleet_controller import convert
from lorafleet_controller.controller import Controller
from lorafleet_controller.registry import ROLLOUT, TRAINER

K = controller_pb2
MAX_WAIT_SECONDS = 60.0


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    # --- tenancy and sessions -------------------------------------------------------------
    async def Authenticate(self, request: Any, context: Any) -> K.AuthenticateResponse:
        tenant, key_id = await self.c.tenancy.authenticate(request.api_key)
        return K.AuthenticateResponse(tenant=tenant, key_id=key_id)

    async def CreateApiKey(self, request: Any, context: Any) -> K.CreateApiKeyResponse:
        api_key, key_id = await self.c.tenancy.create_key(request.tenant, request.label)
        return K.CreateApiKeyResponse(api_key=api_key, key_id=key_id)

    async def ListApiKeys(self, request: Any, context: Any) -> K.ListApiKeysResponse:
        keys = await self.c.tenancy.list_keys(request.tenant)
        return K.ListApiKeysResponse(
            keys=[K.ApiKeyInfo(key_id=k.key_id, tenant=k.tenant, label=k.label,
                               created_at=k.created_at, revoked=k.revoked) for k in keys]
        )  # fmt: skip

    async def RevokeApiKey(self, request: Any, context: Any) -> K.RevokeApiKeyResponse:
        await self.c.tenancy.revoke_key(request.key_id)
        return K.RevokeApiKeyResponse()

    async def CreateSession(self, request: Any, context: Any) -> K.CreateSessionResponse:
        session_id = await self.c.tenancy.create_session(
            request.tenant, list(request.tags), dict(request.user_metadata),
            request.sdk_version, request.project_id, request.display_name,
        )  # fmt: skip
        return K.CreateSessionResponse(session_id=session_id)

    async def SessionHeartbeat(self, request: Any, context: Any) -> K.SessionHeartbeatResponse:
        await self.c.tenancy.heartbeat(request.tenant, request.session_id)
        return K.SessionHeartbeatResponse()

    async def FinishSession(self, request: Any, context: Any) -> K.FinishSessionResponse:
        await self.c.finish_session(request.tenant, request.session_id, request.reason)
        return K.FinishSessionResponse()

    async def GetSession(self, request: Any, context: Any) -> K.GetSessionResponse:
        rec = await self.c.tenancy.get(request.tenant, request.session_id)
        return K.GetSessionResponse(session=convert.session(rec))

    async def ListSessions(self, request: Any, context: Any) -> K.ListSessionsResponse:
        ids, total = await self.c.tenancy.list(request.tenant, request.limit, request.offset)
        return K.ListSessionsResponse(session_ids=ids, total=total)

    # --- registry -------------------------------------------------------------------------
    async def CreateRegistration(self, request: Any, context: Any) -> K.CreateRegistrationResponse:
        rec, load_op = await self.c.create_registration(request)
        return K.CreateRegistrationResponse(
            registration=convert.registration(rec), load_operation_id=load_op
        )

    async def GetRegistration(self, request: Any, context: Any) -> K.GetRegistrationResponse:
        rec = await self.c.registry.get(request.tenant, request.registration_id)
        return K.GetRegistrationResponse(registration=convert.registration(rec))

    async def ListRegistrations(self, request: Any, context: Any) -> K.ListRegistrationsResponse:
        recs, total = await self.c.registry.list(request.tenant, request.limit, request.offset)
        return K.ListRegistrationsResponse(
            registrations=[convert.registration(r) for r in recs], total=total
        )

    async def DeleteRegistration(self, request: Any, context: Any) -> K.DeleteRegistrationResponse:
        await self.c.delete_registration(request.tenant, request.registration_id)
        return K.DeleteRegistrationResponse()

    # --- ledger ---------------------------------------------------------------------------
    async def SubmitOperation(self, request: Any, context: Any) -> K.SubmitOperationResponse:
        rejected = None
        if request.HasField("rejection"):
            rejected = exception_from_info(request.rejection, errors.InvalidArgument)
        adm = await self.c.submit_operation(request, rejected)
        return K.SubmitOperationResponse(
            operation_id=adm.operation_id,
            state=adm.state,
            duplicate=adm.duplicate,  # type: ignore[arg-type]
        )

    async def GetOperation(self, request: Any, context: Any) -> K.GetOperationResponse:
        wait = min(max(request.wait_seconds, 0.0), MAX_WAIT_SECONDS)
        rec = await self.c.ledger.wait(request.tenant, request.operation_id, wait)
        return K.GetOperationResponse(operation=convert.operation(rec))

    async def AckOperation(self, request: Any, context: Any) -> K.AckOperationResponse:
        await self.c.ledger.ack(request.tenant, request.operation_id)
        return K.AckOperationResponse()

    # --- sampling -------------------------------------------------------------------------
    async def CreateSampler(self, request: Any, context: Any) -> K.CreateSamplerResponse:
        rec = await self.c.create_sampler(request)
        return K.CreateSamplerResponse(sampler=convert.sampler(rec))

    async def GetSampler(self, request: Any, context: Any) -> K.GetSamplerResponse:
        rec = await self.c.samplers.get(request.tenant, request.sampler_id)
        return K.GetSamplerResponse(sampler=convert.sampler(rec))

    async def SubmitSample(self, request: Any, context: Any) -> K.SubmitOperationResponse:
        opid, state, dup, seq_ids = await self.c.samplers.submit(request.tenant, request)
        return K.SubmitOperationResponse(
            operation_id=opid,
            state=state,
            duplicate=dup,
            sequence_ids=seq_ids,  # type: ignore[arg-type]
        )

    # --- checkpoints ----------------------------------------------------------------------
    async def ListCheckpoints(self, request: Any, context: Any) -> K.ListCheckpointsResponse:
        recs, total = await self.c.catalog.list(
            request.tenant, request.training_run_id, request.limit, request.offset
        )
        return K.ListCheckpointsResponse(
            checkpoints=[convert.checkpoint(r) for r in recs], total=total
        )

    async def GetCheckpoint(self, request: Any, context: Any) -> K.GetCheckpointResponse:
        rec = await self.c.catalog.get(request.tenant, request.tinker_path)
        return K.GetCheckpointResponse(checkpoint=convert.checkpoint(rec))

    async def DeleteCheckpoint(self, request: Any, context: Any) -> K.DeleteCheckpointResponse:
        await self.c.catalog.delete(request.tenant, request.tinker_path)
        return K.DeleteCheckpointResponse()

    async def UpdateCheckpoint(self, request: Any, context: Any) -> K.UpdateCheckpointResponse:
        rec = await self.c.catalog.update(
            request.tenant,
            request.tinker_path,
            request.public if request.HasField("public") else None,
            request.ttl_seconds if request.HasField("ttl_seconds") else None,
            request.clear_ttl,
        )
        return K.UpdateCheckpointResponse(checkpoint=convert.checkpoint(rec))

    async def DownloadCheckpoint(
        self, request: Any, context: Any
    ) -> AsyncIterator[common_pb2.FileChunk]:
        rec = await self.c.catalog.get(request.tenant, request.tinker_path)
        for chunk in self.c.catalog.chunks(rec):
            yield chunk

    # --- fleet ----------------------------------------------------------------------------
    async def GetCapabilities(self, request: Any, context: Any) -> K.GetCapabilitiesResponse:
        models: dict[str, K.BaseModelInfo] = {}
        for rep in await self.c.registry.replicas():
            if not rep.healthy:
                continue
            info = models.setdefault(rep.base_model, K.BaseModelInfo(name=rep.base_model))
            info.tokenizer_id = info.tokenizer_id or rep.tokenizer_id
            if rep.kind == TRAINER or not info.arch:  # rollouts report their engine here
                info.arch = rep.arch if rep.kind == TRAINER else info.arch or rep.arch
            info.max_context_length = max(info.max_context_length, rep.max_context_length)
            if rep.kind == TRAINER:
                info.trainable = True
                info.max_rank = max(info.max_rank, rep.max_rank)
                for loss in rep.loss_fns:
                    if loss not in info.loss_fns:
                        info.loss_fns.append(loss)
            elif rep.kind == ROLLOUT:
                info.sampleable = True
        return K.GetCapabilitiesResponse(models=[models[k] for k in sorted(models)])

    async def RegisterReplica(self, request: Any, context: Any) -> K.RegisterReplicaResponse:
        await self.c.register_replica(request)
        return K.RegisterReplicaResponse(
            heartbeat_interval_seconds=self.c.settings.heartbeat_interval_seconds
        )

    async def GetFleetStatus(self, request: Any, context: Any) -> K.GetFleetStatusResponse:
        resp = K.GetFleetStatusResponse(ledger_depth=await self.c.ledger.depth())
        queued_ids: list[str] = []
        for rep in await self.c.registry.replicas():
            status = K.ReplicaStatus(
                kind=K.REPLICA_KIND_TRAINER if rep.kind == TRAINER else K.REPLICA_KIND_ROLLOUT,
                replica_id=rep.replica_id, address=rep.address, base_model=rep.base_model,
                healthy=rep.healthy, last_seen=rep.last_seen, num_slots=rep.num_slots,
            )  # fmt: skip
            if rep.kind == TRAINER:
                for _, rid in sorted((await self.c.registry.slot_table(rep.replica_id)).items()):
                    reg = await self.c.registry.get_any(rid)
                    if reg is not None:
                        status.slots.append(convert.registration(reg))
                for rid in await self.c.registry.queued(rep.base_model):
                    if rid not in queued_ids:
                        queued_ids.append(rid)
            else:
                status.adapters.extend(await self._resident(rep.address))
            resp.replicas.append(status)
        for rid in queued_ids:
            reg = await self.c.registry.get_any(rid)
            if reg is not None:
                resp.queued_registrations.append(convert.registration(reg))
        return resp

    async def _resident(self, address: str) -> list[str]:
        rollout = self.c.pool.rollout(address)
        try:
            return [a.adapter_id for a in await rollout.list_adapters(retry=False)]
        except errors.LorafleetError:
            return []
