"""An idle channel from `make_channel` to a `start_server` server, with keepalive sped up to
one ping a second, for the GOAWAY "too_many_pings" test (gRPC logs it on stderr).

`--strict-server` builds the server without the keepalive permissions (gRPC's defaults) to
show the probe sees the GOAWAY when the two ends disagree.
"""

from __future__ import annotations

import asyncio
import sys

from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.rpc import channel, server
from lorafleet.settings import ServerSettings

channel.KEEPALIVE_TIME_MS = 1000
if "--strict-server" in sys.argv:
    server.server_options = channel.message_options  # type: ignore[assignment]


async def main() -> None:
    running = await server.start_server(ServerSettings(port=0), [])
    try:
        async with channel.make_channel(f"127.0.0.1:{running.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await asyncio.sleep(6)  # idle: only keepalive pings cross the connection
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await running.stop()


asyncio.run(main())
