"""Who may call: mutual TLS for every internal RPC, and each RPC only for the roles it admits.

With a `TlsIdentity`, servers accept only clients that present a certificate signed by the
fleet's CA (the handshake refuses anyone else, before any handler runs), and channels
present this process's certificate. The certificate's common name gives the caller's role
(`lorafleet.rpc.roles`, which owns the table of who may call what): a gateway acts for
tenants but never as admin, a trainer only registers itself, admin RPCs need the operator's
certificate (a common name in `admin_names`, the `lorafleet` CLI's).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from lorafleet.rpc.roles import Peer, peer_from_names, refusal
from lorafleet.rpc.types import Request, Response, ServerContext
from lorafleet.settings import SettingsError
from lorafleet.tls import TlsIdentity, identity_from_env

log = logging.getLogger(__name__)


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


def peer_of(context: ServerContext, admin_names: tuple[str, ...]) -> Peer:
    """The verified caller and its role."""
    return peer_from_names(peer_names(context), admin_names)


async def _refuse_unless_allowed(
    context: ServerContext, method: str, admin_names: tuple[str, ...], request: Any = None
) -> None:
    why = refusal(method, peer_of(context, admin_names), request)
    if why is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


async def _stream(behavior: Callable[..., Any], arg: Any, context: ServerContext) -> Any:
    """Run a server-streaming behaviour as an async generator: ours are generators, grpc's
    own Health.Watch writes through `context.write`."""
    if inspect.isasyncgenfunction(behavior):
        async for item in behavior(arg, context):
            yield item
    else:
        await behavior(arg, context)


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, admin_names: tuple[str, ...]
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, checking the caller (and a unary request) before it runs: an aio
    interceptor sees only the method name, the peer and request only reach the handler."""
    codec = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        unary: Callable[..., Any] = handler.unary_unary

        async def unary_unary(request: Any, context: ServerContext) -> Any:
            await _refuse_unless_allowed(context, method, admin_names, request)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, *codec)
    if handler.unary_stream is not None:
        server_stream: Callable[..., Any] = handler.unary_stream

        async def unary_stream(request: Any, context: ServerContext) -> AsyncIterator[Any]:
            await _refuse_unless_allowed(context, method, admin_names, request)
            async for item in _stream(server_stream, request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, *codec)
    if handler.stream_unary is not None:
        client_stream: Callable[..., Any] = handler.stream_unary

        async def stream_unary(requests: Any, context: ServerContext) -> Any:
            await _refuse_unless_allowed(context, method, admin_names)
            return await client_stream(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, *codec)
    both: Callable[..., Any] | None = handler.stream_stream
    assert both is not None, method

    async def stream_stream(requests: Any, context: ServerContext) -> AsyncIterator[Any]:
        await _refuse_unless_allowed(context, method, admin_names)
        async for item in _stream(both, requests, context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, *codec)


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (PERMISSION_DENIED, naming the roles it admits and the caller) every call
    whose caller's role `lorafleet.rpc.roles.RULES` does not admit, methods without an entry
    included. Installed with TLS only: plaintext has no verified caller to check."""

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
        if handler is None:
            return None
        return _guarded(handler, handler_call_details.method, self.admin_names)
