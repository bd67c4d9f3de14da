"""The one way every lorafleet service runs its gRPC server.

Lifecycle, in order: health NOT_SERVING (so readiness fails while a model loads) → bind →
`startup()` → SERVING → … SIGTERM/SIGINT → `enter_graceful_shutdown()` (every service
NOT_SERVING, traffic drains) → `server.stop(grace)` lets in-flight RPCs finish →
`shutdown()` → exit 0. Health tells the truth: it is SERVING only between a completed
startup and the first stop signal.

Transport: mutual TLS when the process has a TLS identity (LORAFLEET_TLS_*, or `tls=` for
in-process servers), with each RPC limited to the roles it admits (`lorafleet.rpc.roles`);
plaintext otherwise, with a warning, for development only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from lorafleet.logging import setup_logging
from lorafleet.rpc.auth import RoleInterceptor, identity_or_exit, server_credentials
from lorafleet.rpc.channel import server_options
from lorafleet.rpc.interceptors import ErrorsAndMetricsInterceptor
from lorafleet.settings import ServerSettings
from lorafleet.tls import TlsIdentity

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class ServiceSpec:
    servicer: Any
    add_fn: Callable[[Any, grpc.aio.Server], None]
    full_name: str


@dataclass
class RunningServer:
    """Handle for in-process servers (tests, benchmarks): the bound port and a stop()."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    names: tuple[str, ...]
    health_server: grpc.aio.Server | None = None  # plaintext Health only (probes)
    health_port: int = 0

    async def stop(self, grace: float = 0.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


async def _start_health_server(
    settings: ServerSettings, servicer: health.aio.HealthServicer
) -> tuple[grpc.aio.Server, int]:
    """Health alone on a plaintext port, for probes that cannot present a client certificate
    (the kubelet's gRPC probe): it tells whether the process serves and nothing else."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.health_port}")
    if port == 0:
        raise OSError(f"cannot bind {settings.host}:{settings.health_port}")
    await server.start()
    return server, port


async def start_server(
    settings: ServerSettings,
    services: Sequence[ServiceSpec],
    startup: Hook | None = None,
    *,
    standby: Sequence[str] = (),
    tls: TlsIdentity | None = None,
) -> RunningServer:
    """Bind, run `startup`, then report SERVING. The caller owns stopping it.

    Services named in `standby` stay NOT_SERVING after startup (a controller replica that
    does not hold the leader lease): the caller flips them when it may serve. `tls`
    defaults to the identity in LORAFLEET_TLS_*.
    """
    tls = tls or identity_or_exit()
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorsAndMetricsInterceptor()]
    if tls is not None:
        interceptors.append(RoleInterceptor(tls.admin_names))
    server = grpc.aio.server(
        interceptors=interceptors, options=server_options(settings.max_message_bytes)
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(spec.full_name for spec in services)
    for spec in services:
        spec.add_fn(spec.servicer, server)
        await health_servicer.set(spec.full_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    if tls is None:
        log.warning(
            "internal gRPC on %s is plaintext and unauthenticated: set "
            "LORAFLEET_TLS_CA_FILE/CERT_FILE/KEY_FILE outside development",
            address,
        )
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials(tls))
    if port == 0:
        raise OSError(f"cannot bind {settings.host}:{settings.port}")
    await server.start()
    running = RunningServer(server, health_servicer, port, names)
    if settings.health_port:
        running.health_server, running.health_port = await _start_health_server(
            settings, health_servicer
        )
    if startup is not None:
        await startup()
    for name in (*names, health.OVERALL_HEALTH):
        if name not in standby:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return running


async def serve_async(
    name: str,
    settings: ServerSettings,
    services: Sequence[ServiceSpec],
    startup: Hook | None = None,
    shutdown: Hook | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    running = await start_server(settings, services, startup)
    log.info("%s serving on %s:%d", name, settings.host, running.port)
    await stop.wait()
    log.info("%s stopping: draining for up to %.1fs", name, settings.grace_seconds)
    await running.stop(settings.grace_seconds)
    if shutdown is not None:
        await shutdown()
    log.info("%s stopped", name)


def serve(
    name: str,
    settings: ServerSettings,
    services: Sequence[ServiceSpec],
    startup: Hook | None = None,
    shutdown: Hook | None = None,
) -> None:
    """Blocking entry point for `__main__`: logging, the event loop, and the server."""
    setup_logging(name, settings.log_level)
    asyncio.run(serve_async(name, settings, services, startup, shutdown))
