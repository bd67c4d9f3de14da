"""The gateway's only dependency: a typed, deadline-carrying client of ControllerService.

Every call has an explicit deadline and turns a failed RPC back into the domain exception
the controller raised (field and message preserved), so routers only ever see
`lorafleet.errors`. Transport retries (UNAVAILABLE only) are enabled for every RPC the
controller documents as idempotent, which is all of them except CreateSession.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet.v1 import controller_pb2_grpc

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

# Deadlines the controller documents per RPC (controller.proto), in seconds.
_LONG = {"CreateRegistration": 30.0, "CreateSampler": 60.0, "DeleteCheckpoint": 30.0}


class Controller:
    """Async ControllerService client; `await controller.call("GetSession", request)`."""

    def __init__(self, address: str, default_timeout: float) -> None:
        self.channel = make_channel(address, idempotent_methods=IDEMPOTENT)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)
        self.default_timeout = default_timeout

    async def call(self, method: str, request: Any, deadline: float | None = None) -> Any:
        deadline = deadline or max(self.default_timeout, _LONG.get(method, 0.0))
        try:
            return await getattr(self.stub, method)(request, timeout=deadline)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def get_operation(self, tenant: str, operation_id: str, wait: float) -> Any:
        request = cpb.GetOperationRequest(
            tenant=tenant, operation_id=operation_id, wait_seconds=wait
        )
        return (await self.call("GetOperation", request, deadline=wait + 5.0)).operation

    async def download(self, tenant: str, tinker_path: str) -> AsyncIterator[Any]:
        """The checkpoint's files as FileChunk messages (DownloadCheckpoint stream)."""
        request = cpb.DownloadCheckpointRequest(tenant=tenant, tinker_path=tinker_path)
        try:
            async for chunk in self.stub.DownloadCheckpoint(request, timeout=300.0):
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self.channel.close()
