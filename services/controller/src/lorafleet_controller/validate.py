"""Payload validation and the idempotency digest of operations.

A payload arrives as the bytes the gateway serialised (SubmitOperationRequest.payload), and
the tensors in it are never parsed here: the kind is read from the tag of the payload's one
field, and forward / forward_backward bytes are hashed, stored and forwarded as they are
(their rules are lorafleet.validate_msgs.check_forward_backward's, run by the gateway and by
the trainer that acts on them). The small control payloads the controller acts on are parsed
and checked here.

A payload that fails here still consumes its seq_id as a born-terminal FAILED(user) record
(design-lessons §3.6), so validation returns the error instead of raising it. The digest is
SHA-256 over the kind and the deterministic protobuf serialization of the payload, minus
the fields an SDK re-mints on its own retries (`sampling_session_seq_id`, §9).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from google.protobuf.message import DecodeError

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
DATA_KINDS = frozenset(
    {controller_pb2.OPERATION_KIND_FORWARD, controller_pb2.OPERATION_KIND_FORWARD_BACKWARD}
)
"""Kinds whose payload carries tensors: stored and forwarded as bytes, parsed by the trainer."""

_FIELDS = controller_pb2.OperationPayload.DESCRIPTOR.fields_by_name
_KIND_OF_TAG = {(_FIELDS[name].number << 3) | 2: kind for name, kind in KIND_OF_FIELD.items()}
"""The tag byte of each kind's field (length-delimited, field numbers under 16)."""


@dataclass(frozen=True)
class Admitted:
    """What admission needs of a payload: its kind, its digest, and why it is refused."""

    kind: int
    digest: str
    rejection: errors.LorafleetError | None


def payload_kind(payload: controller_pb2.OperationPayload) -> int:
    which = payload.WhichOneof("kind")
    return KIND_OF_FIELD[which] if which else controller_pb2.OPERATION_KIND_UNSPECIFIED


def wire_kind(body: bytes) -> int:
    """The kind of a serialized OperationPayload, read without parsing it: a oneof payload
    serialises as exactly one length-delimited field, so the first byte is that field's
    tag and its length covers the rest. Anything else (no field, an unknown one, trailing
    fields) is OPERATION_KIND_UNSPECIFIED."""
    kind = _KIND_OF_TAG.get(body[0]) if body else None
    if kind is None:
        return controller_pb2.OPERATION_KIND_UNSPECIFIED
    length, shift, pos = 0, 0, 1
    while pos < len(body) and shift < 64:
        byte = body[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            return kind if pos + length == len(body) else controller_pb2.OPERATION_KIND_UNSPECIFIED
        shift += 7
    return controller_pb2.OPERATION_KIND_UNSPECIFIED


def admit(body: bytes) -> Admitted:
    """Kind, digest and first problem of a serialized payload. Data payloads are hashed as
    they are (the gateway serialised them deterministically, so a retry hashes alike); a
    control payload is parsed, checked and hashed in its canonical form."""
    kind = wire_kind(body)
    if kind in DATA_KINDS:
        return Admitted(kind, hashlib.sha256(b"%d:" % kind + body).hexdigest(), None)
    try:
        payload = controller_pb2.OperationPayload.FromString(body)
    except DecodeError:
        payload = None
    if payload is None or kind != payload_kind(payload):
        refused = errors.InvalidArgument(
            "not one serialized operation (an OperationPayload with one kind set)",
            field="payload",
        )
        return Admitted(kind, "invalid:" + hashlib.sha256(body).hexdigest(), refused)
    return Admitted(kind, digest(payload), validate(payload))


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
