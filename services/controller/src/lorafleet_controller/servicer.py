"""ControllerService: translates protobuf requests to controller calls and back.

No logic lives here: every method unpacks its request (into domain values, `convert.py`),
calls a flow (`flows/`) or one of the controller's Redis-backed parts, and packs the answer.
Failures are `lorafleet.errors` exceptions that the shared interceptor maps to status codes;
nothing here calls `context.abort`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from lorafleet import errors
from lorafleet.rpc.errors import exception_from_info
from lorafleet.rpc.types import ServerContext
from lorafleet.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from lorafleet_controller import convert
from lorafleet_controller.controller import Controller
from lorafleet_controller.peft_import import Importer

pb = controller_pb2
MAX_WAIT_SECONDS = 60.0


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    # --- tenancy and sessions -------------------------------------------------------------
    async def Authenticate(
        self, request: pb.AuthenticateRequest, context: ServerContext
    ) -> pb.AuthenticateResponse:
        tenant, key_id = await self.controller.tenancy.authenticate(request.api_key)
        return pb.AuthenticateResponse(tenant=tenant, key_id=key_id)

    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: ServerContext
    ) -> pb.CreateApiKeyResponse:
        api_key, key_id = await self.controller.tenancy.create_key(request.tenant, request.label)
        return pb.CreateApiKeyResponse(api_key=api_key, key_id=key_id)

    async def ListApiKeys(
        self, request: pb.ListApiKeysRequest, context: ServerContext
    ) -> pb.ListApiKeysResponse:
        keys = await self.controller.tenancy.list_keys(request.tenant)
        return pb.ListApiKeysResponse(
            keys=[
                pb.ApiKeyInfo(
                    key_id=k.key_id,
                    tenant=k.tenant,
                    label=k.label,
                    created_at=k.created_at,
                    revoked=k.revoked,
                )
                for k in keys
            ]
        )

    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: ServerContext
    ) -> pb.RevokeApiKeyResponse:
        await self.controller.sessions.revoke_api_key(request.key_id)
        return pb.RevokeApiKeyResponse()

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: ServerContext
    ) -> pb.CreateSessionResponse:
        session_id = await self.controller.tenancy.create_session(
            request.tenant,
            list(request.tags),
            dict(request.user_metadata),
            request.sdk_version,
            request.project_id,
            request.display_name,
            request.key_id,
        )
        return pb.CreateSessionResponse(session_id=session_id)

    async def SessionHeartbeat(
        self, request: pb.SessionHeartbeatRequest, context: ServerContext
    ) -> pb.SessionHeartbeatResponse:
        await self.controller.tenancy.heartbeat(request.tenant, request.session_id)
        return pb.SessionHeartbeatResponse()

    async def FinishSession(
        self, request: pb.FinishSessionRequest, context: ServerContext
    ) -> pb.FinishSessionResponse:
        await self.controller.sessions.finish(request.tenant, request.session_id, request.reason)
        return pb.FinishSessionResponse()

    async def GetSession(
        self, request: pb.GetSessionRequest, context: ServerContext
    ) -> pb.GetSessionResponse:
        rec = await self.controller.tenancy.get(request.tenant, request.session_id)
        return pb.GetSessionResponse(session=convert.session(rec))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: ServerContext
    ) -> pb.ListSessionsResponse:
        ids, total = await self.controller.tenancy.list(
            request.tenant, request.limit, request.offset
        )
        return pb.ListSessionsResponse(session_ids=ids, total=total)

    # --- registry -------------------------------------------------------------------------
    async def CreateRegistration(
        self, request: pb.CreateRegistrationRequest, context: ServerContext
    ) -> pb.CreateRegistrationResponse:
        rec, load_op = await self.controller.registrations.create(convert.new_registration(request))
        return pb.CreateRegistrationResponse(
            registration=convert.registration(rec), load_operation_id=load_op
        )

    async def GetRegistration(
        self, request: pb.GetRegistrationRequest, context: ServerContext
    ) -> pb.GetRegistrationResponse:
        rec = await self.controller.registry.get(request.tenant, request.registration_id)
        return pb.GetRegistrationResponse(registration=convert.registration(rec))

    async def ListRegistrations(
        self, request: pb.ListRegistrationsRequest, context: ServerContext
    ) -> pb.ListRegistrationsResponse:
        recs, total = await self.controller.registry.of_tenant(
            request.tenant, request.limit, request.offset
        )
        return pb.ListRegistrationsResponse(
            registrations=[convert.registration(r) for r in recs], total=total
        )

    async def DeleteRegistration(
        self, request: pb.DeleteRegistrationRequest, context: ServerContext
    ) -> pb.DeleteRegistrationResponse:
        await self.controller.registrations.delete(request.tenant, request.registration_id)
        return pb.DeleteRegistrationResponse()

    # --- ledger ---------------------------------------------------------------------------
    async def SubmitOperation(
        self, request: pb.SubmitOperationRequest, context: ServerContext
    ) -> pb.SubmitOperationResponse:
        sub = convert.submission(request)
        if request.HasField("rejection"):
            rejected = exception_from_info(request.rejection, errors.InvalidArgument)
            adm = await self.controller.operations.reject(sub, request.rejection, rejected)
        else:
            adm = await self.controller.operations.submit(sub)
        return pb.SubmitOperationResponse(
            operation_id=adm.operation_id,
            state=controller_pb2.OperationState.ValueType(adm.state),
            duplicate=adm.duplicate,
        )

    async def GetOperation(
        self, request: pb.GetOperationRequest, context: ServerContext
    ) -> pb.GetOperationResponse:
        wait = min(max(request.wait_seconds, 0.0), MAX_WAIT_SECONDS)
        rec = await self.controller.ledger.wait(request.tenant, request.operation_id, wait)
        return pb.GetOperationResponse(operation=convert.operation(rec))

    async def AckOperation(
        self, request: pb.AckOperationRequest, context: ServerContext
    ) -> pb.AckOperationResponse:
        await self.controller.ledger.ack(request.tenant, request.operation_id)
        return pb.AckOperationResponse()

    # --- sampling -------------------------------------------------------------------------
    async def CreateSampler(
        self, request: pb.CreateSamplerRequest, context: ServerContext
    ) -> pb.CreateSamplerResponse:
        rec = await self.controller.sampling.create(convert.new_sampler(request))
        return pb.CreateSamplerResponse(sampler=convert.sampler(rec))

    async def GetSampler(
        self, request: pb.GetSamplerRequest, context: ServerContext
    ) -> pb.GetSamplerResponse:
        rec = await self.controller.samplers.get(request.tenant, request.sampler_id)
        return pb.GetSamplerResponse(sampler=convert.sampler(rec))

    async def SubmitSample(
        self, request: pb.SubmitSampleRequest, context: ServerContext
    ) -> pb.SubmitOperationResponse:
        submission = convert.sample_submission(request)
        opid, state, dup, seq_ids = await self.controller.samplers.submit(submission)
        return pb.SubmitOperationResponse(
            operation_id=opid,
            state=controller_pb2.OperationState.ValueType(state),
            duplicate=dup,
            sequence_ids=seq_ids,
        )

    # --- checkpoints ----------------------------------------------------------------------
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: ServerContext
    ) -> pb.ListCheckpointsResponse:
        recs, total = await self.controller.catalog.list(
            request.tenant, request.training_run_id, request.limit, request.offset
        )
        return pb.ListCheckpointsResponse(
            checkpoints=[convert.checkpoint(r) for r in recs], total=total
        )

    async def GetCheckpoint(
        self, request: pb.GetCheckpointRequest, context: ServerContext
    ) -> pb.GetCheckpointResponse:
        rec = await self.controller.catalog.get(request.tenant, request.tinker_path)
        return pb.GetCheckpointResponse(checkpoint=convert.checkpoint(rec))

    async def DeleteCheckpoint(
        self, request: pb.DeleteCheckpointRequest, context: ServerContext
    ) -> pb.DeleteCheckpointResponse:
        await self.controller.catalog.delete(request.tenant, request.tinker_path)
        return pb.DeleteCheckpointResponse()

    async def UpdateCheckpoint(
        self, request: pb.UpdateCheckpointRequest, context: ServerContext
    ) -> pb.UpdateCheckpointResponse:
        rec = await self.controller.catalog.update(
            request.tenant,
            request.tinker_path,
            request.public if request.HasField("public") else None,
            request.ttl_seconds if request.HasField("ttl_seconds") else None,
            request.clear_ttl,
        )
        return pb.UpdateCheckpointResponse(checkpoint=convert.checkpoint(rec))

    async def DownloadCheckpoint(
        self, request: pb.DownloadCheckpointRequest, context: ServerContext
    ) -> AsyncIterator[common_pb2.FileChunk]:
        catalog = self.controller.catalog
        rec = await catalog.get(request.tenant, request.tinker_path)
        async for chunk in catalog.chunks(rec, names_only=request.names_only):
            yield chunk

    async def ImportPeftAdapter(
        self, request: pb.ImportPeftAdapterRequest, context: ServerContext
    ) -> pb.ImportPeftAdapterResponse:
        path, rid, base, lora = await Importer(self.controller).run(
            request.tenant, request.name, request.base_model, dict(request.files)
        )
        return pb.ImportPeftAdapterResponse(
            path=path, training_run_id=rid, base_model=base, lora_config=lora
        )

    async def GetUsage(
        self, request: pb.GetUsageRequest, context: ServerContext
    ) -> pb.GetUsageResponse:
        return pb.GetUsageResponse(tenants=await self.controller.usage.totals(request.tenant))

    async def PageOutRegistration(
        self, request: pb.PageOutRegistrationRequest, context: ServerContext
    ) -> pb.PageOutRegistrationResponse:
        done = await self.controller.pager.page_out(request.registration_id, replay=request.force)
        return pb.PageOutRegistrationResponse(state=done.state.proto, seconds=done.seconds)

    # --- fleet ----------------------------------------------------------------------------
    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: ServerContext
    ) -> pb.GetCapabilitiesResponse:
        models = await self.controller.fleet.capabilities()
        return pb.GetCapabilitiesResponse(models=[convert.base_model(m) for m in models])

    async def RegisterReplica(
        self, request: pb.RegisterReplicaRequest, context: ServerContext
    ) -> pb.RegisterReplicaResponse:
        await self.controller.replicas.register(convert.replica(request))
        return pb.RegisterReplicaResponse(
            heartbeat_interval_seconds=self.controller.settings.heartbeat_interval_seconds
        )

    async def GetFleetStatus(
        self, request: pb.GetFleetStatusRequest, context: ServerContext
    ) -> pb.GetFleetStatusResponse:
        return convert.fleet_status(await self.controller.fleet.status())

    async def ReportReplicaFailed(
        self, request: pb.ReportReplicaFailedRequest, context: ServerContext
    ) -> pb.ReportReplicaFailedResponse:
        stranded = await self.controller.replicas.failed(request.replica_id, request.reason)
        return pb.ReportReplicaFailedResponse(stranded=stranded)
