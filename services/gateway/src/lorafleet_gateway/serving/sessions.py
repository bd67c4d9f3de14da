"""Sessions and heartbeats (tinker-api.md §6.2, §6.5)."""

from __future__ import annotations

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, views
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    CreateSessionRequest,
    CreateSessionResponse,
    ListSessionsResponse,
    SessionInfo,
)


class SessionServing:
    def __init__(self, controller: ControllerClient) -> None:
        self._controller = controller

    async def create(
        self, tenant: str, key_id: str, body: CreateSessionRequest
    ) -> CreateSessionResponse:
        request = cpb.CreateSessionRequest(
            tenant=tenant,
            key_id=key_id,
            tags=body.tags,
            user_metadata=convert.metadata(body.user_metadata),
            sdk_version=body.sdk_version,
            project_id=body.project_id or "",
            display_name=body.display_name or "",
        )
        reply = await self._controller.create_session(request)
        return CreateSessionResponse(session_id=reply.session_id)

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        request = cpb.SessionHeartbeatRequest(tenant=tenant, session_id=session_id)
        try:
            await self._controller.session_heartbeat(request)
        except errors.FailedPrecondition as exc:  # finished: 0.38 stops heartbeating on 410
            raise errors.Expired(exc.message, field="session_id", reason=exc.reason) from None

    async def finish(self, tenant: str, session_id: str, reason: str) -> None:
        request = cpb.FinishSessionRequest(tenant=tenant, session_id=session_id, reason=reason)
        await self._controller.finish_session(request)

    async def list(self, tenant: str, limit: int, offset: int) -> ListSessionsResponse:
        request = cpb.ListSessionsRequest(tenant=tenant, limit=limit, offset=offset)
        reply = await self._controller.list_sessions(request)
        return ListSessionsResponse(
            sessions=list(reply.session_ids), cursor=views.cursor(offset, limit, reply.total)
        )

    async def get(self, tenant: str, session_id: str) -> SessionInfo:
        request = cpb.GetSessionRequest(tenant=tenant, session_id=session_id)
        session = (await self._controller.get_session(request)).session
        return SessionInfo(
            session_id=session.session_id,
            training_run_ids=list(session.training_run_ids),
            sampler_ids=list(session.sampler_ids),
            user_metadata=dict(session.user_metadata),
            display_name=session.display_name or None,
        )
