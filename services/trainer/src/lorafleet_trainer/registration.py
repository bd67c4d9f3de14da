"""Keeps this replica registered with the controller (RegisterReplica every few seconds).

Registration doubles as the heartbeat. The controller may be absent or restarting: a
failed call is logged once per outage and retried, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from lorafleet.rpc.channel import make_channel
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        controller_address: str,
        request: controller_pb2.RegisterReplicaRequest,
        interval: float,
    ) -> None:
        self.controller_address = controller_address
        self.request = request
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="register-replica")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        channel = make_channel(self.controller_address)
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        failing = False
        try:
            while True:
                interval = self.interval
                try:
                    resp = await stub.RegisterReplica(self.request, timeout=5.0)
                    if resp.heartbeat_interval_seconds > 0:
                        interval = min(self.interval, resp.heartbeat_interval_seconds)
                    if failing:
                        log.info("registered with the controller at %s", self.controller_address)
                    failing = False
                except grpc.RpcError as exc:
                    if not failing:
                        log.warning(
                            "cannot register with the controller at %s: %s",
                            self.controller_address,
                            exc.code(),
                        )
                    failing = True
                await asyncio.sleep(interval)
        finally:
            await channel.close()
