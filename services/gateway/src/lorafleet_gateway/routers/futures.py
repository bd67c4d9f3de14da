"""retrieve_future: long-poll an operation's result (tinker-api.md §3).

The answer is JSON, or protobuf for forward/backward and sample results when Accept asks
for it; a delivered terminal result is acknowledged after the response has been sent (a
background task), which frees the ledger's unacked-results budget.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.background import BackgroundTask

from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import FutureResult, RetrieveFutureRequest
from lorafleet_gateway.serving.futures import PROTO

router = APIRouter(prefix="/api/v1", tags=["futures"])
_RESULTS: dict[int | str, dict[str, Any]] = {
    200: {
        "model": FutureResult,
        "content": {PROTO: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("/retrieve_future", response_class=Response, responses=_RESULTS)
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, tenant: Tenant, serving: Areas
) -> Response:
    accept_proto = PROTO in request.headers.get("accept", "")
    reply = await serving.futures.retrieve(tenant, body.request_id, accept_proto)
    background = BackgroundTask(serving.futures.ack, tenant, reply.ack) if reply.ack else None
    return Response(reply.body, media_type=reply.media_type, background=background)
