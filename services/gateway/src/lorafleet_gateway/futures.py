"""Tinker's futures on top of the controller's ledger (tinker-api.md §3).

A submit answers {"request_id": operation_id, ...} at once; retrieve_future long-polls the
controller's GetOperation and renders the terminal record as the result type the SDK expects
for that operation kind: protobuf for forward/backward and sample results when the Accept
header asks for it (0.38 always does), JSON otherwise; {"error", "category"} for failures;
410 once a result was acknowledged or expired; {"type": "try_again"} while it is queued.

Two futures need no ledger record, because their work is done synchronously by the submit
(CreateRegistration, DeleteRegistration): their request ids carry the model id
("create:<model_id>", "unload:<model_id>") and are answered from the registry.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from lorafleet import errors
from lorafleet.rpc.errors import error_info
from lorafleet.v1 import common_pb2
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert

PROTO = "application/x-protobuf"
CREATE = "create:"
UNLOAD = "unload:"
EXTERNAL = "external:"

_CATEGORY = {
    common_pb2.ERROR_CATEGORY_USER: "user",
    common_pb2.ERROR_CATEGORY_SERVER: "server",
}
TERMINAL = frozenset(
    {
        cpb.OPERATION_STATE_SUCCEEDED,
        cpb.OPERATION_STATE_FAILED,
        cpb.OPERATION_STATE_CANCELLED,
    }
)


def submitted(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": request_id}
    if model_id:
        body["model_id"] = model_id
    body.update(extra)
    return body


def try_again(request_id: str, waiting_reason: str = "") -> dict[str, Any]:
    state = "paused_capacity" if "slot" in waiting_reason else "active"
    body: dict[str, Any] = {"type": "try_again", "request_id": request_id, "queue_state": state}
    if waiting_reason:
        body["queue_state_reason"] = waiting_reason
    return body


def failure(op: cpb.Operation) -> dict[str, Any]:
    info = op.error
    message = info.message or ("cancelled" if op.state == cpb.OPERATION_STATE_CANCELLED else "")
    text = f"{info.field}: {message}" if info.field else message or "operation failed"
    return {"error": text, "category": _CATEGORY.get(info.category, "unknown")}


def _result_json(op: cpb.Operation, result: Any, kind: str | None) -> dict[str, Any]:
    if kind == "optim_step":
        return {"metrics": dict(result.metrics)}
    if kind == "save_state":
        return {"path": result.path, "type": "save_weights"}
    if kind == "load_state":
        model_id = result.registration_id or op.registration_id
        return {"path": result.path or None, "model_id": model_id, "type": "load_weights"}
    if kind == "save_weights_for_sampler":
        if result.path:
            return {"path": result.path, "type": "save_weights_for_sampler"}
        return {"sampling_session_id": result.sampler_id, "type": "save_weights_for_sampler"}
    if kind == "create":
        return {"model_id": result.registration_id, "type": "create_model"}
    raise errors.Internal(f"operation {op.operation_id} has no result for kind {op.kind}")


def external_result(op: cpb.Operation, name: str) -> dict[str, Any]:
    """save_weights_external rides on save_state (see routers/weights.py)."""
    path = f"tinker://{op.registration_id}/external_weights/{name}"
    return {"path": path, "type": "save_weights_external"}


def render(op: cpb.Operation, accept_proto: bool, external_name: str = "") -> Response:
    """The HTTP response for a terminal operation."""
    if op.state == cpb.OPERATION_STATE_EXPIRED:
        raise errors.Expired(f"result of {op.operation_id} was already delivered or expired")
    if op.state != cpb.OPERATION_STATE_SUCCEEDED:
        return JSONResponse(failure(op))
    kind = op.result.WhichOneof("kind")
    result = getattr(op.result, kind) if kind else None
    if kind == "forward_backward":
        if accept_proto:
            return Response(convert.fb_output_proto(result), media_type=PROTO)
        return JSONResponse(convert.fb_output_json(result))
    if kind == "sample":
        if accept_proto:
            return Response(convert.sample_output_proto(result), media_type=PROTO)
        return JSONResponse(convert.sample_output_json(result))
    if external_name and kind == "save_state":
        return JSONResponse(external_result(op, external_name))
    return JSONResponse(_result_json(op, result, kind))


async def submit(
    ctl: Any, tenant: str, model_id: str, seq_id: int, payload: cpb.OperationPayload
) -> cpb.SubmitOperationResponse:
    """SubmitOperation at (registration = model_id, seq_id): the ledger orders, dedups
    (same payload → the original operation) and refuses conflicts (422) and overload (429)."""
    request = cpb.SubmitOperationRequest(
        tenant=tenant, registration_id=model_id, seq_id=seq_id, payload=payload
    )
    return await ctl.call("SubmitOperation", request)


async def spend_rejected(
    ctl: Any, tenant: str, model_id: str, seq_id: int, exc: errors.LorafleetError
) -> None:
    """The gateway refused this request's payload: still spend its seq_id in the ledger.

    The SDK has already used that seq_id and sends its next request with the next one; an
    unspent seq_id would hold the run's queue until the gap timeout seals it. Best effort:
    if the ledger refuses too (unknown run, another tenant), the client's 4xx stands alone.
    """
    if seq_id <= 0 or not model_id:
        return
    request = cpb.SubmitOperationRequest(
        tenant=tenant, registration_id=model_id, seq_id=seq_id, rejection=error_info(exc)
    )
    with contextlib.suppress(errors.LorafleetError):
        await ctl.call("SubmitOperation", request)
