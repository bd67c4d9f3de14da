"""`ControllerClient`: the gateway's only dependency, one typed method per ControllerService RPC
(and `JobsClient`, its `jobs`, one per JobService RPC: the controller serves both).

Every call carries the deadline controller.proto documents for that RPC and turns a failed
RPC back into the domain exception the controller raised (field and message preserved), so
the serving layer only ever sees `lorafleet.errors`. Transport retries (UNAVAILABLE only)
are enabled for every RPC the controller documents as idempotent, which is all of those used
here except CreateSession. Capabilities are cached here for a few seconds, because get_info
and every base-model lookup need them and they change only when replicas come and go.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import TypeVar

import grpc

from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.v1 import common_pb2, controller_pb2_grpc, jobs_pb2, jobs_pb2_grpc
from lorafleet.v1 import controller_pb2 as cpb

SERVICE = "lorafleet.v1.ControllerService"
IDEMPOTENT = tuple(
    f"/{SERVICE}/{name}"
    for name in (
        "Authenticate",
        "SessionHeartbeat",
        "FinishSession",
        "GetSession",
        "ListSessions",
        "CreateRegistration",
        "GetRegistration",
        "ListRegistrations",
        "DeleteRegistration",
        "SubmitOperation",
        "GetOperation",
        "AckOperation",
        "CreateSampler",
        "GetSampler",
        "SubmitSample",
        "ListCheckpoints",
        "GetCheckpoint",
        "DeleteCheckpoint",
        "UpdateCheckpoint",
        "DownloadCheckpoint",
        "GetCapabilities",
    )
)
JOBS_SERVICE = "lorafleet.v1.JobService"
JOBS_IDEMPOTENT = tuple(
    f"/{JOBS_SERVICE}/{name}" for name in ("GetJob", "ListJobs", "CancelJob", "ResetDefaultRun")
)
CAPABILITIES_TTL = 5.0
# Deadlines controller.proto documents, in seconds (short RPCs use the configured default).
CREATE_REGISTRATION_DEADLINE = 30.0
DELETE_DEADLINE = 30.0
CREATE_SAMPLER_DEADLINE = 60.0
# A download streams at its HTTP client's pace (nothing is buffered): 1.6 GB at 1 MB/s.
DOWNLOAD_DEADLINE = 3600.0
# What a download's stream may hold ahead of its HTTP client: gRPC's floor for a grown window.
STREAM_WINDOW_BYTES = 4 << 20
IMPORT_DEADLINE = 600.0
CREATE_JOB_DEADLINE = 60.0
RESET_RUN_DEADLINE = 30.0
POLL_MARGIN = 5.0

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _Client:
    """A typed stub's calls: the longer of the default timeout and the RPC's deadline, and a
    failed RPC raised as the domain exception the controller raised."""

    def __init__(self, default_timeout: float) -> None:
        self._timeout = default_timeout

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        deadline: float = 0.0,
    ) -> Resp:
        try:
            return await method(request, timeout=max(self._timeout, deadline))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None


class JobsClient(_Client):
    """Async JobService client on the controller's channel: `await client.jobs.get_job(...)`."""

    def __init__(self, channel: grpc.aio.Channel, default_timeout: float) -> None:
        super().__init__(default_timeout)
        self._stub = jobs_pb2_grpc.JobServiceStub(channel)

    async def create_job(self, request: jobs_pb2.CreateJobRequest) -> jobs_pb2.CreateJobResponse:
        return await self._call(self._stub.CreateJob, request, CREATE_JOB_DEADLINE)

    async def get_job(self, request: jobs_pb2.GetJobRequest) -> jobs_pb2.GetJobResponse:
        """Long-polls inside the controller for up to `request.wait_seconds`."""
        deadline = request.wait_seconds + POLL_MARGIN
        return await self._call(self._stub.GetJob, request, deadline)

    async def list_jobs(self, request: jobs_pb2.ListJobsRequest) -> jobs_pb2.ListJobsResponse:
        return await self._call(self._stub.ListJobs, request)

    async def cancel_job(self, request: jobs_pb2.CancelJobRequest) -> jobs_pb2.CancelJobResponse:
        return await self._call(self._stub.CancelJob, request)

    async def reset_default_run(
        self, request: jobs_pb2.ResetDefaultRunRequest
    ) -> jobs_pb2.ResetDefaultRunResponse:
        return await self._call(self._stub.ResetDefaultRun, request, RESET_RUN_DEADLINE)


class ControllerClient(_Client):
    """Async ControllerService client: `await client.get_session(request)`; `jobs` is the
    JobService client on the same channel."""

    def __init__(self, address: str, default_timeout: float) -> None:
        super().__init__(default_timeout)
        self._channel = make_channel(
            address,
            idempotent_methods=IDEMPOTENT + JOBS_IDEMPOTENT,
            stream_window_bytes=STREAM_WINDOW_BYTES,
        )
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)
        self.jobs = JobsClient(self._channel, default_timeout)
        self._capabilities: tuple[list[cpb.BaseModelInfo], float] | None = None

    async def close(self) -> None:
        await self._channel.close()

    # --- tenancy and sessions ---------------------------------------------------------------
    async def authenticate(self, request: cpb.AuthenticateRequest) -> cpb.AuthenticateResponse:
        return await self._call(self._stub.Authenticate, request)

    async def create_session(self, request: cpb.CreateSessionRequest) -> cpb.CreateSessionResponse:
        return await self._call(self._stub.CreateSession, request)

    async def session_heartbeat(
        self, request: cpb.SessionHeartbeatRequest
    ) -> cpb.SessionHeartbeatResponse:
        return await self._call(self._stub.SessionHeartbeat, request)

    async def finish_session(self, request: cpb.FinishSessionRequest) -> cpb.FinishSessionResponse:
        return await self._call(self._stub.FinishSession, request)

    async def get_session(self, request: cpb.GetSessionRequest) -> cpb.GetSessionResponse:
        return await self._call(self._stub.GetSession, request)

    async def list_sessions(self, request: cpb.ListSessionsRequest) -> cpb.ListSessionsResponse:
        return await self._call(self._stub.ListSessions, request)

    # --- registry ---------------------------------------------------------------------------
    async def create_registration(
        self, request: cpb.CreateRegistrationRequest
    ) -> cpb.CreateRegistrationResponse:
        return await self._call(
            self._stub.CreateRegistration, request, CREATE_REGISTRATION_DEADLINE
        )

    async def get_registration(
        self, request: cpb.GetRegistrationRequest
    ) -> cpb.GetRegistrationResponse:
        return await self._call(self._stub.GetRegistration, request)

    async def list_registrations(
        self, request: cpb.ListRegistrationsRequest
    ) -> cpb.ListRegistrationsResponse:
        return await self._call(self._stub.ListRegistrations, request)

    async def delete_registration(
        self, request: cpb.DeleteRegistrationRequest
    ) -> cpb.DeleteRegistrationResponse:
        return await self._call(self._stub.DeleteRegistration, request, DELETE_DEADLINE)

    # --- ledger -----------------------------------------------------------------------------
    async def submit_operation(
        self, request: cpb.SubmitOperationRequest
    ) -> cpb.SubmitOperationResponse:
        return await self._call(self._stub.SubmitOperation, request)

    async def get_operation(self, request: cpb.GetOperationRequest) -> cpb.GetOperationResponse:
        """Long-polls inside the controller for up to `request.wait_seconds`."""
        deadline = request.wait_seconds + POLL_MARGIN
        return await self._call(self._stub.GetOperation, request, deadline)

    async def ack_operation(self, request: cpb.AckOperationRequest) -> cpb.AckOperationResponse:
        return await self._call(self._stub.AckOperation, request)

    # --- sampling ---------------------------------------------------------------------------
    async def create_sampler(self, request: cpb.CreateSamplerRequest) -> cpb.CreateSamplerResponse:
        return await self._call(self._stub.CreateSampler, request, CREATE_SAMPLER_DEADLINE)

    async def get_sampler(self, request: cpb.GetSamplerRequest) -> cpb.GetSamplerResponse:
        return await self._call(self._stub.GetSampler, request)

    async def submit_sample(self, request: cpb.SubmitSampleRequest) -> cpb.SubmitOperationResponse:
        return await self._call(self._stub.SubmitSample, request)

    # --- checkpoints ------------------------------------------------------------------------
    async def list_checkpoints(
        self, request: cpb.ListCheckpointsRequest
    ) -> cpb.ListCheckpointsResponse:
        return await self._call(self._stub.ListCheckpoints, request)

    async def get_checkpoint(self, request: cpb.GetCheckpointRequest) -> cpb.GetCheckpointResponse:
        return await self._call(self._stub.GetCheckpoint, request)

    async def delete_checkpoint(
        self, request: cpb.DeleteCheckpointRequest
    ) -> cpb.DeleteCheckpointResponse:
        return await self._call(self._stub.DeleteCheckpoint, request, DELETE_DEADLINE)

    async def update_checkpoint(
        self, request: cpb.UpdateCheckpointRequest
    ) -> cpb.UpdateCheckpointResponse:
        return await self._call(self._stub.UpdateCheckpoint, request)

    async def import_peft_adapter(
        self, request: cpb.ImportPeftAdapterRequest
    ) -> cpb.ImportPeftAdapterResponse:
        return await self._call(self._stub.ImportPeftAdapter, request, IMPORT_DEADLINE)

    async def download_checkpoint(
        self, request: cpb.DownloadCheckpointRequest
    ) -> AsyncGenerator[common_pb2.FileChunk, None]:
        """The checkpoint's files as consecutive FileChunk messages (a server stream); closed
        before the end, it cancels the call, so the controller stops reading."""
        call = self._stub.DownloadCheckpoint(request, timeout=DOWNLOAD_DEADLINE)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    # --- fleet ------------------------------------------------------------------------------
    async def get_capabilities(
        self, request: cpb.GetCapabilitiesRequest
    ) -> cpb.GetCapabilitiesResponse:
        return await self._call(self._stub.GetCapabilities, request)

    async def capabilities(self) -> list[cpb.BaseModelInfo]:
        """The served base models, from GetCapabilities at most every CAPABILITIES_TTL s."""
        if self._capabilities and self._capabilities[1] > time.monotonic():
            return self._capabilities[0]
        models = list((await self.get_capabilities(cpb.GetCapabilitiesRequest())).models)
        self._capabilities = (models, time.monotonic() + CAPABILITIES_TTL)
        return models
