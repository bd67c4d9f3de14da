"""retrieve_future: long-poll the controller for an operation's result (tinker-api.md §3).

The poll waits up to `long_poll_seconds` inside the controller (GetOperation's wait), well
under the SDK's 45 s read timeout, then answers try_again and the SDK re-polls at once. A
delivered terminal result is acknowledged after the response has been sent (a background
task), which frees the ledger's unacked-results budget; polling it again answers 410.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import futures
from lorafleet_gateway.controller import Controller
from lorafleet_gateway.deps import Ctl, Settings, Tenant
from lorafleet_gateway.protocol import RetrieveFutureRequest

router = APIRouter(prefix="/api/v1", tags=["futures"])
log = logging.getLogger(__name__)


async def _ack(ctl: Controller, tenant: str, operation_id: str) -> None:
    try:
        await ctl.call(
            "AckOperation", cpb.AckOperationRequest(tenant=tenant, operation_id=operation_id)
        )
    except errors.LorafleetError as exc:  # the result expires by TTL anyway
        log.warning("ack of %s failed: %s", operation_id, exc)


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, tenant: Tenant, ctl: Ctl, settings: Settings
) -> Response:
    rid = body.request_id
    if rid.startswith(futures.CREATE):
        lookup = cpb.GetRegistrationRequest(
            tenant=tenant, registration_id=rid[len(futures.CREATE) :]
        )
        reg = (await ctl.call("GetRegistration", lookup)).registration
        return JSONResponse({"model_id": reg.registration_id, "type": "create_model"})
    if rid.startswith(futures.UNLOAD):
        return JSONResponse({"model_id": rid[len(futures.UNLOAD) :], "type": "unload_model"})
    operation_id, external_name = rid, ""
    if rid.startswith(futures.EXTERNAL):
        external_name, _, operation_id = rid[len(futures.EXTERNAL) :].partition(":")
    op = await ctl.get_operation(tenant, operation_id, settings.long_poll_seconds)
    if op.state not in futures.TERMINAL and op.state != cpb.OPERATION_STATE_EXPIRED:
        return JSONResponse(futures.try_again(rid, op.waiting_reason))
    accept_proto = futures.PROTO in request.headers.get("accept", "")
    response = futures.render(op, accept_proto, external_name)
    if settings.ack_results:
        response.background = BackgroundTask(_ack, ctl, tenant, operation_id)
    return response
