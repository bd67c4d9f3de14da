"""Server interceptors: errors → status codes, and the standard gRPC server metrics.

An aio `intercept_service` only sees the handler, not the outcome, so both interceptors
wrap the handler's behaviour (the pattern of grpc's service-latency example). Metric names
are the go-grpc-prometheus ones, so stock gRPC dashboards work unchanged.

A client-streaming RPC refused before the client half-closes is read out before the status
goes back: a grpc aio client whose write is in flight as the call ends reports INTERNAL
("Internal error from Core") in place of the server's status (grpc#36066), so our own
callers would see a refusal they cannot act on as an internal fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from lorafleet import errors
from lorafleet.rpc.errors import status_code_for, trailing_metadata
from lorafleet.rpc.types import Request, Response, ServerContext

log = logging.getLogger(__name__)

_LABELS = ("grpc_type", "grpc_service", "grpc_method")
STARTED = Counter("grpc_server_started_total", "RPCs started on the server.", _LABELS)
HANDLED = Counter(
    "grpc_server_handled_total", "RPCs completed on the server.", (*_LABELS, "grpc_code")
)
HANDLING = Histogram(
    "grpc_server_handling_seconds",
    "Response latency of RPCs handled by the server.",
    _LABELS,
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


DRAIN_S = 30.0
"""How long a refused client stream is read out (and discarded) before the status goes back
anyway: a legitimate stream ends well within it; one that does not gets the status regardless."""


async def _drain(requests: AsyncIterator[Any]) -> None:
    with contextlib.suppress(Exception):  # the timeout too: the status goes back either way
        async with asyncio.timeout(DRAIN_S):
            async for _ in requests:
                pass


def _split(method: str) -> tuple[str, str]:
    _, service, name = method.split("/", 2) if method.count("/") >= 2 else ("", "", method)
    return service, name


def _rpc_type(handler: grpc.RpcMethodHandler[Request, Response]) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


async def _abort(context: ServerContext, exc: errors.LorafleetError) -> None:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", exc, exc_info=exc)
    await context.abort(code, str(exc), trailing_metadata(exc))


def _wrap(
    handler: grpc.RpcMethodHandler[Request, Response], method: str
) -> grpc.RpcMethodHandler[Request, Response]:
    service, name = _split(method)
    labels = (_rpc_type(handler), service, name)

    def finish(context: ServerContext, start: float, failed: bool) -> None:
        code = context.code() if hasattr(context, "code") else None
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        name_ = code.name if isinstance(code, grpc.StatusCode) else str(code)
        HANDLED.labels(*labels, name_).inc()
        HANDLING.labels(*labels).observe(time.perf_counter() - start)

    def unary_result(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(request_or_iterator: Any, context: ServerContext) -> Any:
            STARTED.labels(*labels).inc()
            start, failed = time.perf_counter(), False
            try:
                return await behavior(request_or_iterator, context)
            except errors.LorafleetError as exc:
                failed = True
                if handler.request_streaming:
                    await _drain(request_or_iterator)
                await _abort(context, exc)
            except Exception:
                failed = True
                raise
            finally:
                finish(context, start, failed)

        return wrapper

    def streaming_result(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(request_or_iterator: Any, context: ServerContext) -> Any:
            STARTED.labels(*labels).inc()
            start, failed = time.perf_counter(), False
            try:
                async for item in behavior(request_or_iterator, context):
                    yield item
            except errors.LorafleetError as exc:
                failed = True
                await _abort(context, exc)
            except Exception:
                failed = True
                raise
            finally:
                finish(context, start, failed)

        return wrapper

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            unary_result(handler.unary_unary),
            handler.request_deserializer,
            handler.response_serializer,
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary_result(handler.stream_unary),
            handler.request_deserializer,
            handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            streaming_result(handler.unary_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )
    assert handler.stream_stream is not None  # every handler has exactly one behaviour
    return grpc.stream_stream_rpc_method_handler(
        streaming_result(handler.stream_stream),
        handler.request_deserializer,
        handler.response_serializer,
    )


class ErrorsAndMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions to statuses and records grpc_server_* metrics for every RPC."""

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
        return _wrap(handler, handler_call_details.method)
