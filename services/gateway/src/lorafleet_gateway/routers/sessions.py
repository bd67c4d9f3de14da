"""Sessions, heartbeats, telemetry and the session REST views (tinker-api.md §6.2, §6.5)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert, views
from lorafleet_gateway.deps import Ctl, Tenant
from lorafleet_gateway.protocol import (
    CreateSessionRequest,
    FinishSessionRequest,
    SessionHeartbeatRequest,
    TelemetryRequest,
)

router = APIRouter(prefix="/api/v1", tags=["sessions"])


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.CreateSessionRequest(
        tenant=tenant,
        tags=body.tags,
        user_metadata=convert.metadata(body.user_metadata),
        sdk_version=body.sdk_version,
        project_id=body.project_id or "",
        display_name=body.display_name or "",
    )
    reply = await ctl.call("CreateSession", request)
    return {
        "type": "create_session",
        "session_id": reply.session_id,
        "info_message": None,
        "warning_message": None,
        "error_message": None,
    }


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionHeartbeatRequest, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.SessionHeartbeatRequest(tenant=tenant, session_id=body.session_id)
    try:
        await ctl.call("SessionHeartbeat", request)
    except errors.FailedPrecondition as exc:  # finished: 0.38 stops heartbeating on 410
        raise errors.Expired(exc.message, field="session_id", reason=exc.reason) from None
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, tenant: Tenant, ctl: Ctl, body: FinishSessionRequest | None = None
) -> dict:
    reason = body.reason.type if body and body.reason else "success"
    request = cpb.FinishSessionRequest(tenant=tenant, session_id=session_id, reason=reason)
    await ctl.call("FinishSession", request)
    return {}


@router.post("/telemetry")
async def telemetry(body: TelemetryRequest) -> dict:
    """Accepted and dropped: the SDK retries a failed batch every second forever."""
    return {"status": "accepted"}


@router.get("/sessions")
async def list_sessions(
    tenant: Tenant,
    ctl: Ctl,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, lt=2**31),
) -> dict:
    request = cpb.ListSessionsRequest(tenant=tenant, limit=limit, offset=offset)
    reply = await ctl.call("ListSessions", request)
    return {"sessions": list(reply.session_ids), "cursor": views.cursor(offset, limit, reply.total)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.GetSessionRequest(tenant=tenant, session_id=session_id)
    session = (await ctl.call("GetSession", request)).session
    return {
        "session_id": session.session_id,
        "training_run_ids": list(session.training_run_ids),
        "sampler_ids": list(session.sampler_ids),
        "user_metadata": dict(session.user_metadata),
        "display_name": session.display_name or None,
    }
