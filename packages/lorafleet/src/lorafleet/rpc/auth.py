"""Who may call: mutual TLS for every internal RPC, an admin certificate for admin RPCs.

With a `TlsIdentity`, servers accept only clients that present a certificate signed by the
fleet's CA (the handshake refuses anyone else, before any handler runs), and channels
present this process's certificate. Service certificates may call every RPC except those in
`ADMIN_METHODS`: minting, listing and revoking API keys and the fleet-wide status cross
tenants, so a compromised gateway or trainer cannot mint itself a key. Those need a
certificate whose common name is one of `admin_names` (the `lorafleet` CLI's).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from lorafleet.rpc.types import Request, Response, ServerContext
from lorafleet.settings import SettingsError
from lorafleet.tls import TlsIdentity, identity_from_env

log = logging.getLogger(__name__)

ADMIN_METHODS = frozenset(
    f"/lorafleet.v1.ControllerService/{name}"
    for name in (
        "CreateApiKey",
        "ListApiKeys",
        "RevokeApiKey",
        "GetFleetStatus",
        "GetUsage",
        "ReportReplicaFailed",
        "PageOutRegistration",
    )
)


def identity_or_exit() -> TlsIdentity | None:
    """The process's TLS identity from LORAFLEET_TLS_*; bad settings print one line, exit 2."""
    try:
        return identity_from_env()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(identity.key, identity.cert)],
        root_certificates=identity.ca,
        require_client_auth=True,
    )


def channel_credentials(identity: TlsIdentity) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=identity.ca, private_key=identity.key, certificate_chain=identity.cert
    )


def channel_options(identity: TlsIdentity | None) -> list[tuple[str, str]]:
    """Check servers against the fleet-wide name when peers are dialed by IP."""
    if identity is not None and identity.server_name:
        return [("grpc.ssl_target_name_override", identity.server_name)]
    return []


def peer_names(context: ServerContext) -> list[str]:
    """Common names of the verified client certificate (empty over plaintext)."""
    auth = context.auth_context() or {}
    return [v.decode() for v in auth.get("x509_common_name", [])]


def _admin_only(
    behavior: Callable[..., Any], method: str, admin_names: tuple[str, ...]
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: ServerContext) -> Any:
        names = peer_names(context)
        if not set(names) & set(admin_names):
            who = ", ".join(names) or "no client certificate"
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.rsplit('/', 1)[-1]} needs an admin certificate (caller: {who})",
            )
        return await behavior(request, context)

    return wrapper


class AdminInterceptor(grpc.aio.ServerInterceptor):
    """Refuses `ADMIN_METHODS` (PERMISSION_DENIED) unless the client certificate is admin's.

    An aio interceptor cannot see the peer, only the method, so admin handlers are wrapped
    to check `context.auth_context()` when they run; other methods pass through untouched.
    """

    def __init__(self, admin_names: tuple[str, ...]) -> None:
        self.admin_names = admin_names

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Request, Response] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in ADMIN_METHODS:
            return handler
        if not handler.unary_unary:
            raise TypeError(f"admin method {method} must be unary-unary")
        return grpc.unary_unary_rpc_method_handler(
            _admin_only(handler.unary_unary, method, self.admin_names),
            handler.request_deserializer,
            handler.response_serializer,
        )
