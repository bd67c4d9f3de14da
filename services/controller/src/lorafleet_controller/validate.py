"""Payload validation and the idempotency digest of operations.

A payload that fails here still consumes its seq_id as a born-terminal FAILED(user) record
(design-lessons §3.6), so validation returns the error instead of raising it. The digest is
SHA-256 over the kind and the deterministic protobuf serialization of the payload, minus
the fields an SDK re-mints on its own retries (`sampling_session_seq_id`, §9).
"""

from __future__ import annotations

import hashlib
import math
import re

from lorafleet import errors
from lorafleet.v1 import controller_pb2

KIND_OF_FIELD = {
    "forward": controller_pb2.OPERATION_KIND_FORWARD,
    "forward_backward": controller_pb2.OPERATION_KIND_FORWARD_BACKWARD,
    "optim_step": controller_pb2.OPERATION_KIND_OPTIM_STEP,
    "save_state": controller_pb2.OPERATION_KIND_SAVE_STATE,
    "load_state": controller_pb2.OPERATION_KIND_LOAD_STATE,
    "save_weights_for_sampler": controller_pb2.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
}
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
PATH_RE = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")


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
    """`tinker://<run>/<weights|sampler_weights>/<name>` → (run, type, name)."""
    m = PATH_RE.match(path)
    if not m or not NAME_RE.match(m.group(3)) or m.group(3) in (".", ".."):
        raise errors.InvalidArgument(
            f"{path!r} is not tinker://<run>/weights/<name> or .../sampler_weights/<name>",
            field=field,
        )
    return m.group(1), m.group(2), m.group(3)


def check_name(name: str, field: str) -> None:
    if not NAME_RE.match(name) or name in (".", ".."):
        raise errors.InvalidArgument(
            f"{name!r} must match [A-Za-z0-9._-]{{1,128}} (and not be . or ..)", field=field
        )


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
    if which in ("forward", "forward_backward"):
        fb = getattr(payload, which)
        if not fb.data:
            raise errors.InvalidArgument("at least one datum is required", field="data")
        if not fb.loss_fn:
            raise errors.InvalidArgument("loss_fn is required", field="loss_fn")
        for i, datum in enumerate(fb.data):
            if not datum.tokens:
                raise errors.InvalidArgument("empty token list", field=f"data[{i}].tokens")
            if any(t < 0 for t in datum.tokens):
                raise errors.InvalidArgument("negative token id", field=f"data[{i}].tokens")
    elif which == "optim_step":
        _check_adam(payload.optim_step)
    elif which == "save_state":
        check_name(payload.save_state.name, "name")
        if payload.save_state.ttl_seconds < 0:
            raise errors.InvalidArgument("must be >= 0", field="ttl_seconds")
    elif which == "load_state":
        parse_tinker_path(payload.load_state.path, "path")
    elif which == "save_weights_for_sampler":
        sw = payload.save_weights_for_sampler
        if sw.name:
            check_name(sw.name, "name")
        elif not sw.sampler_session_id:
            raise errors.InvalidArgument(
                "either a name or a sampler_session_id is required", field="name"
            )
        if sw.kind not in ("", "snapshot", "inflight"):
            raise errors.InvalidArgument("must be 'snapshot' or 'inflight'", field="kind")
        if sw.ttl_seconds < 0:
            raise errors.InvalidArgument("must be >= 0", field="ttl_seconds")


def _check_adam(adam: object) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, name)
        if not math.isfinite(value):
            raise errors.InvalidArgument(f"{value} is not finite", field=f"adam_params.{name}")
    a = adam
    if a.learning_rate < 0:  # type: ignore[attr-defined]
        raise errors.InvalidArgument("must be >= 0", field="adam_params.learning_rate")
    for beta in ("beta1", "beta2"):
        if not 0 <= getattr(a, beta) < 1:
            raise errors.InvalidArgument("must be in [0, 1)", field=f"adam_params.{beta}")
    if a.eps <= 0:  # type: ignore[attr-defined]
        raise errors.InvalidArgument("must be > 0", field="adam_params.eps")
    if a.weight_decay < 0:  # type: ignore[attr-defined]
        raise errors.InvalidArgument("must be >= 0", field="adam_params.weight_decay")
    if a.grad_clip_norm < 0:  # type: ignore[attr-defined]
        raise errors.InvalidArgument("must be >= 0", field="adam_params.grad_clip_norm")
