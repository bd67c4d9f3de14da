"""Domain exceptions shared by every service.

Domain code (ledger, trainer engine, rollout engine) raises these and never imports grpc;
the one server interceptor in `lorafleet.rpc.errors` maps each to a gRPC status code, and
the gateway maps the status codes to HTTP. Each error names the request field that was
wrong, so a user sees "data[2].loss_fn_inputs.weights: ..." instead of a stack trace.
"""

from __future__ import annotations


class LorafleetError(Exception):
    """Base class. `category` is Tinker's blame: "user" or "server"."""

    category = "server"

    def __init__(self, message: str, *, field: str = "", reason: str = "") -> None:
        self.message = message
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(LorafleetError):
    """The request is malformed or out of range; nothing was changed."""

    category = "user"


class NotFound(LorafleetError):
    """The named object does not exist (or belongs to another tenant)."""

    category = "user"


class AlreadyExists(LorafleetError):
    """An immutable name is already taken."""

    category = "user"


class FailedPrecondition(LorafleetError):
    """The request is valid but the current state forbids it (fences, pending gradients)."""

    category = "user"


class Conflict(LorafleetError):
    """A retry carried a different payload for an identity already used. Never retried."""

    category = "user"


class ResourceExhausted(LorafleetError):
    """Backpressure: nothing was admitted; retry after `retry_after` seconds."""

    category = "server"

    def __init__(
        self, message: str, *, retry_after: float = 1.0, field: str = "", reason: str = ""
    ) -> None:
        super().__init__(message, field=field, reason=reason)
        self.retry_after = retry_after


class Unavailable(LorafleetError):
    """A dependency (replica, Redis) cannot be reached right now; safe to retry."""

    category = "server"


class Expired(LorafleetError):
    """The result was acknowledged or outlived its TTL (Tinker: HTTP 410)."""

    category = "user"


class PermissionDenied(LorafleetError):
    """Missing or wrong credentials."""

    category = "user"


class Internal(LorafleetError):
    """A bug or an unexpected failure on our side."""

    category = "server"
