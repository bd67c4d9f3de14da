"""Sessions, heartbeats, telemetry and the session REST views (tinker-api.md §6.2, §6.5)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    CreateSessionRequest,
    CreateSessionResponse,
    Empty,
    FinishSessionRequest,
    ListSessionsResponse,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    SessionInfo,
    TelemetryRequest,
    TelemetryResponse,
)

router = APIRouter(prefix="/api/v1", tags=["sessions"])


@router.post("/create_session")
async def create_session(
    body: CreateSessionRequest, tenant: Tenant, serving: Areas, request: Request
) -> CreateSessionResponse:
    return await serving.sessions.create(tenant, request.state.key_id, body)


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: SessionHeartbeatRequest, tenant: Tenant, serving: Areas
) -> SessionHeartbeatResponse:
    await serving.sessions.heartbeat(tenant, body.session_id)
    return SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, tenant: Tenant, serving: Areas, body: FinishSessionRequest | None = None
) -> Empty:
    reason = body.reason.type if body and body.reason else "success"
    await serving.sessions.finish(tenant, session_id, reason)
    return Empty()


@router.post("/telemetry")
async def telemetry(body: TelemetryRequest, tenant: Tenant) -> TelemetryResponse:
    """Accepted and dropped: the SDK retries a failed batch every second forever."""
    return TelemetryResponse()


@router.get("/sessions")
async def list_sessions(
    tenant: Tenant,
    serving: Areas,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, lt=2**31),
) -> ListSessionsResponse:
    return await serving.sessions.list(tenant, limit, offset)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, tenant: Tenant, serving: Areas) -> SessionInfo:
    return await serving.sessions.get(tenant, session_id)
