"""retrieve_future: Tinker's futures on top of the controller's ledger (tinker-api.md §3).

A submit answered a `FutureId`. Polling an operation long-polls the controller's
GetOperation (up to `long_poll_seconds`, well under the SDK's 45 s read timeout) and renders
the terminal record as the result type the SDK expects for that kind: protobuf for
forward/backward and sample results when the Accept header asks for it (0.38 always does),
JSON otherwise; {"error", "category"} for failures; 410 once a result was released (the
controller's acked-result grace after it was delivered, or its TTL unread);
{"type": "try_again"} while it is queued. Creating and unloading a model are done
synchronously by their submit, so those futures are answered from the registry.

Non-finite numbers (a loss that overflowed float32) cannot be written as JSON: such a result
is answered as a user error naming the first non-finite field, never as a 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from lorafleet import contract, errors
from lorafleet.contract import FutureId, FutureKind
from lorafleet.v1 import common_pb2
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import convert
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    LoadWeightsResult,
    ModelResult,
    OptimStepResult,
    PathResult,
    RequestFailed,
    SamplerResult,
    TryAgain,
)
from lorafleet_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
JSON = "application/json"

_CATEGORY: dict[int, Literal["user", "server"]] = {
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
# What a queued operation waits on → Tinker's queue_state: lack of capacity is "paused".
PAUSED = frozenset({cpb.WAITING_FOR_SLOT, cpb.WAITING_FOR_TRAINER})


@dataclass(frozen=True)
class FutureReply:
    """A rendered retrieve_future answer; `ack` names the operation to acknowledge once the
    answer was sent (empty: nothing to acknowledge)."""

    body: bytes
    media_type: str
    ack: str = ""


def _json(model: BaseModel | dict[str, Any]) -> FutureReply:
    data = model.model_dump(mode="json") if isinstance(model, BaseModel) else model
    return FutureReply(json.dumps(data, allow_nan=False).encode(), JSON)


def try_again(future_id: str, op: cpb.Operation) -> TryAgain:
    return TryAgain(
        request_id=future_id,
        queue_state="paused_capacity" if op.waiting_for in PAUSED else "active",
        queue_state_reason=op.waiting_reason or None,
    )


def failure(op: cpb.Operation) -> RequestFailed:
    info = op.error
    message = info.message or ("cancelled" if op.state == cpb.OPERATION_STATE_CANCELLED else "")
    text = f"{info.field}: {message}" if info.field else message or "operation failed"
    return RequestFailed(error=text, category=_CATEGORY.get(info.category, "unknown"))


def _not_json(exc: errors.InvalidArgument) -> RequestFailed:
    return RequestFailed(
        error=f"{exc}: the result cannot be sent as JSON (ask for protobuf results, as "
        "tinker 0.38 does, or keep the loss inside float32's range)",
        category="user",
    )


def render(op: cpb.Operation, accept_proto: bool, external_name: str = "") -> FutureReply:
    """The answer for a terminal operation."""
    if op.state == cpb.OPERATION_STATE_EXPIRED:
        raise errors.Expired(f"result of {op.operation_id} was already delivered or expired")
    if op.state != cpb.OPERATION_STATE_SUCCEEDED:
        return _json(failure(op))
    result = cpb.OperationResult.FromString(op.result)  # the one parse of the trainer's bytes
    kind = result.WhichOneof("kind")
    try:
        if kind == "forward_backward":
            if accept_proto:
                return FutureReply(convert.fb_output_proto(result.forward_backward), PROTO)
            return _json(convert.fb_output_json(result.forward_backward))
        if kind == "sample":
            if accept_proto:
                return FutureReply(convert.sample_output_proto(result.sample), PROTO)
            return _json(convert.sample_output_json(result.sample))
        if kind == "optim_step":
            metrics = convert.finite_metrics(result.optim_step.metrics, "metrics")
            return _json(OptimStepResult(metrics=metrics))
    except errors.InvalidArgument as exc:
        return _json(_not_json(exc))
    if kind == "save_state":
        if external_name:
            external = contract.CheckpointKind.EXTERNAL_WEIGHTS
            path = str(contract.TinkerPath(op.registration_id, external, external_name))
            return _json(PathResult(type="save_weights_external", path=path))
        return _json(PathResult(type="save_weights", path=result.save_state.path))
    if kind == "load_state":
        load = result.load_state
        model_id = load.registration_id or op.registration_id
        return _json(LoadWeightsResult(path=load.path or None, model_id=model_id))
    if kind == "save_weights_for_sampler":
        saved = result.save_weights_for_sampler
        if saved.path:
            return _json(PathResult(type="save_weights_for_sampler", path=saved.path))
        return _json(SamplerResult(sampling_session_id=saved.sampler_id))
    if kind == "create":
        return _json(ModelResult(type="create_model", model_id=result.create.registration_id))
    raise errors.Internal(f"operation {op.operation_id} has no result for kind {op.kind}")


class FutureServing:
    def __init__(self, controller: ControllerClient, settings: GatewaySettings) -> None:
        self._controller = controller
        self._wait = settings.long_poll_seconds
        self._ack = settings.ack_results

    async def retrieve(self, tenant: str, request_id: str, accept_proto: bool) -> FutureReply:
        future_id = FutureId.parse(request_id)
        if future_id.kind is FutureKind.CREATE:
            lookup = cpb.GetRegistrationRequest(tenant=tenant, registration_id=future_id.ref)
            reg = (await self._controller.get_registration(lookup)).registration
            if reg.failed:  # the trainer refused to bind it: the create fails with that error
                raise contract.run_failure(reg.failed)
            return _json(ModelResult(type="create_model", model_id=reg.registration_id))
        if future_id.kind is FutureKind.UNLOAD:
            return _json(ModelResult(type="unload_model", model_id=future_id.ref))
        request = cpb.GetOperationRequest(
            tenant=tenant, operation_id=future_id.ref, wait_seconds=self._wait
        )
        op = (await self._controller.get_operation(request)).operation
        if op.state not in TERMINAL and op.state != cpb.OPERATION_STATE_EXPIRED:
            return _json(try_again(request_id, op))
        reply = render(op, accept_proto, future_id.name)
        if self._ack:
            return FutureReply(reply.body, reply.media_type, ack=op.operation_id)
        return reply

    async def ack(self, tenant: str, operation_id: str) -> None:
        """Release a delivered result in the ledger (best effort: it expires by TTL anyway)."""
        try:
            request = cpb.AckOperationRequest(tenant=tenant, operation_id=operation_id)
            await self._controller.ack_operation(request)
        except errors.LorafleetError as exc:
            log.warning("ack of %s failed: %s", operation_id, exc)
