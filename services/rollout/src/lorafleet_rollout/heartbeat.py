"""Registering with the controller and re-registering as a heartbeat.

The controller may start after us, restart, or be absent altogether: failures are logged
(once per outage) and retried, and sampling never depends on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from lorafleet.rpc.channel import make_channel
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


async def register_forever(
    controller_address: str,
    request: Callable[[], controller_pb2.RegisterReplicaRequest],
    interval: float,
) -> None:
    """RegisterReplica every `interval` s (or as the controller asks) until cancelled."""
    channel = make_channel(
        controller_address, idempotent_methods=("/lorafleet.v1.ControllerService/RegisterReplica",)
    )
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    failing = False
    try:
        while True:
            delay = interval
            try:
                reply = await stub.RegisterReplica(request(), timeout=5.0)
                if reply.heartbeat_interval_seconds > 0:
                    delay = reply.heartbeat_interval_seconds
                if failing:
                    log.info("registered with the controller at %s again", controller_address)
                failing = False
            except grpc.aio.AioRpcError as exc:
                if not failing:
                    log.warning(
                        "cannot register with the controller at %s: %s; retrying every %.1fs",
                        controller_address, exc.code().name, interval,
                    )  # fmt: skip
                failing = True
            await asyncio.sleep(delay)
    finally:
        await channel.close()
