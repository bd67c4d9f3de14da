"""A service built only from the shared runtime, for the lifecycle test.

It serves `test.Sleep/Sleep` (sleeps the requested seconds) so the test can prove that
SIGTERM lets an in-flight RPC finish within the grace period.
"""

from __future__ import annotations

import asyncio

import grpc

from lorafleet.rpc.server import ServiceSpec, serve
from lorafleet.settings import ServerSettings, load_or_exit


async def _sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(float(request.decode() or 0))
    return b"slept"


def _add(servicer: object, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        "test.Sleep", {"Sleep": grpc.unary_unary_rpc_method_handler(_sleep)}
    )
    server.add_generic_rpc_handlers((handler,))


async def _startup() -> None:
    await asyncio.sleep(0.5)  # stands in for loading a model: health must say NOT_SERVING


if __name__ == "__main__":
    settings = load_or_exit(ServerSettings, "LORAFLEET_TEST_")
    serve("runtime-test", settings, [ServiceSpec(None, _add, "test.Sleep")], startup=_startup)
