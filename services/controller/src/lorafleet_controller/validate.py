"""Payload validation and the idempotency digest of operations.

A payload that fails here still consumes its seq_id as a born-terminal FAILED(user) record
(design-lessons §3.6), so validation returns the error instead of raising it. The digest is
SHA-256 over the kind and the deterministic protobuf serialization of the payload, minus
the fields an SDK re-mints on its own retries (`sampling_session_seq_id`, §9).
"""

from __future__ import annotations

import hashlib

from lorafleet import contract, errors, names
from lorafleet.v1 import controller_pb2

KIND_OF_FIELD = {
    "forward": controller_pb2.OPERATION_KIND_FORWARD,
    "forward_backward": controller_pb2.OPERATION_KIND_FORWARD_BACKWARD,
    "optim_step": controller_pb2.OPERATION_KIND_OPTIM_STEP,
    "save_state": controller_pb2.OPERATION_KIND_SAVE_STATE,
    "load_state": controller_pb2.OPERATION_KIND_LOAD_STATE,
    "save_weights_for_sampler": controller_pb2.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
}


def payload_kind(payload: controller_pb2.OperationPayload) -> int:
    which = payload.WhichOneof("kind")
    return KIND_OF_FIELD[which] if which else controller_pb2.OPERATION_KIND_UNSPECIFIED


def digest(payload: controller_pb2.OperationPayload) -> str:
    canonical = controller_pb2.OperationPayload()
    canonical.CopyFrom(payload)
    if canonical.WhichOneof("kind") == "save_weights_for_sampler":
        canonical.save_weights_for_sampler.sampling_session_seq_id = 0
        canonical.save_weights_for_sampler.sampler_session_id = ""
    body = canonical.SerializeToString(deterministic=True)
    return hashlib.sha256(b"%d:" % payload_kind(payload) + body).hexdigest()


def parse_tinker_path(path: str, field: str) -> tuple[str, str, str]:
    """`tinker://<run>/<weights|sampler_weights>/<name>` → (run, type, name): the contract's
    TinkerPath, limited to the kinds the controller stores, with a valid name."""
    parsed = contract.TinkerPath.parse(path, field)
    if parsed.kind is contract.CheckpointKind.EXTERNAL_WEIGHTS:
        raise errors.InvalidArgument(
            f"{path!r} is not tinker://<run>/weights/<name> or .../sampler_weights/<name>",
            field=field,
        )
    names.check_name(parsed.name, field)
    return parsed.run_id, parsed.kind.value, parsed.name


def validate(payload: controller_pb2.OperationPayload) -> errors.LorafleetError | None:
    """The first problem of a payload (as a user error naming its field), or None."""
    try:
        _validate(payload)
    except errors.LorafleetError as exc:
        return exc
    return None


def _validate(payload: controller_pb2.OperationPayload) -> None:
    which = payload.WhichOneof("kind")
    if which is None:
        raise errors.InvalidArgument("no operation kind set", field="payload")
    # forward / forward_backward: lorafleet.validate_msgs.check_forward_backward owns their
    # rules, run by the gateway and by the trainer that acts on them (a restatement drifts).
    if which == "optim_step":
        adam = payload.optim_step
        contract.check_adam({name: getattr(adam, name) for name in contract.ADAM_RULES})
    elif which == "save_state":
        names.check_name(payload.save_state.name, "name")
        if payload.save_state.ttl_seconds < 0:
            raise errors.InvalidArgument("must be >= 0", field="ttl_seconds")
    elif which == "load_state":
        parse_tinker_path(payload.load_state.path, "path")
    elif which == "save_weights_for_sampler":
        sw = payload.save_weights_for_sampler
        if sw.name:
            names.check_name(sw.name, "name")
        elif not sw.sampler_session_id:
            raise errors.InvalidArgument(
                "either a name or a sampler_session_id is required", field="name"
            )
        if sw.kind not in ("", "snapshot", "inflight"):
            raise errors.InvalidArgument("must be 'snapshot' or 'inflight'", field="kind")
        if sw.ttl_seconds < 0:
            raise errors.InvalidArgument("must be >= 0", field="ttl_seconds")
