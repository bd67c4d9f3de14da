"""The one mapping between domain exceptions and gRPC status codes.

Servers: the error interceptor turns a raised `LorafleetError` into a status code, a
"field: message" details string and a serialized `ErrorInfo` (plus `retry-after` for
backpressure) in the trailing metadata. Clients: `from_rpc_error` turns a failed call back
into the same domain exception, so a trainer's "data[1].weights: non-finite" reaches the
gateway, and the user, unchanged.
"""

from __future__ import annotations

from typing import Any

import grpc

from lorafleet import errors
from lorafleet.v1 import common_pb2

ERROR_INFO_KEY = "lorafleet-error-bin"
RETRY_AFTER_KEY = "retry-after"

_TO_CODE: dict[type[errors.LorafleetError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Conflict: grpc.StatusCode.ABORTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Expired: grpc.StatusCode.OUT_OF_RANGE,
    errors.PermissionDenied: grpc.StatusCode.UNAUTHENTICATED,
    errors.Internal: grpc.StatusCode.INTERNAL,
}
_FROM_CODE: dict[grpc.StatusCode, type[errors.LorafleetError]] = {
    code: cls for cls, code in _TO_CODE.items()
}
_FROM_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = errors.Unavailable
_FROM_CODE[grpc.StatusCode.CANCELLED] = errors.Unavailable

_CATEGORY = {
    "user": common_pb2.ERROR_CATEGORY_USER,
    "server": common_pb2.ERROR_CATEGORY_SERVER,
}


def status_code_for(exc: errors.LorafleetError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _TO_CODE:
            return _TO_CODE[cls]
    return grpc.StatusCode.INTERNAL


def error_info(exc: errors.LorafleetError) -> common_pb2.ErrorInfo:
    """The protobuf form of a domain error (also stored on failed ledger operations)."""
    return common_pb2.ErrorInfo(
        category=_CATEGORY.get(exc.category, common_pb2.ERROR_CATEGORY_UNKNOWN),
        field=exc.field,
        message=exc.message,
        reason=exc.reason or type(exc).__name__,
    )


def trailing_metadata(exc: errors.LorafleetError) -> tuple[tuple[str, str | bytes], ...]:
    md: list[tuple[str, str | bytes]] = [(ERROR_INFO_KEY, error_info(exc).SerializeToString())]
    if isinstance(exc, errors.ResourceExhausted):
        md.append((RETRY_AFTER_KEY, f"{exc.retry_after:.3f}"))
    return tuple(md)


def exception_from_info(
    info: common_pb2.ErrorInfo, cls: type[errors.LorafleetError] | None = None
) -> errors.LorafleetError:
    """Rebuild a domain exception from a stored ErrorInfo (for example a failed operation)."""
    by_reason = {c.__name__: c for c in _TO_CODE}
    cls = (
        cls
        or by_reason.get(info.reason)
        or (
            errors.InvalidArgument
            if info.category == common_pb2.ERROR_CATEGORY_USER
            else errors.Internal
        )
    )
    return cls(info.message, field=info.field, reason=info.reason)


def from_rpc_error(exc: grpc.RpcError) -> errors.LorafleetError:
    """The domain exception a failed call stands for (field, message and retry-after kept)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    # (key, value) pairs: grpc.aio.Metadata or the sync API's tuples of _Metadatum.
    pairs: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
    md = dict(pairs or ())
    cls = _FROM_CODE.get(code, errors.Internal)
    raw = md.get(ERROR_INFO_KEY)
    if raw:
        info = common_pb2.ErrorInfo.FromString(raw)
        err = cls(info.message, field=info.field, reason=info.reason)
    else:
        details = exc.details() if hasattr(exc, "details") else str(exc)
        err = cls(details or code.name, reason=code.name)
    if isinstance(err, errors.ResourceExhausted):
        try:
            err.retry_after = float(md.get(RETRY_AFTER_KEY, "1"))
        except (TypeError, ValueError):
            err.retry_after = 1.0
    return err
