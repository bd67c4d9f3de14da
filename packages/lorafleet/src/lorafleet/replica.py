"""A replica's registration with the controller, which doubles as its heartbeat.

Trainers and rollouts both announce themselves with RegisterReplica and repeat it as a
heartbeat; one module owns the settings, the interval rule and the retry behaviour so the
two cannot drift. The controller may start after the replica, restart, or be absent: a
failed call is retried with capped exponential backoff (tenacity), logged once per outage,
and never fatal. The replica heartbeats at the shorter of its own interval and the one the
controller asks for (the controller knows its miss window; a replica must not be slower).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from lorafleet.rpc.channel import make_channel
from lorafleet.settings import setting
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)
REGISTER_METHOD = "/lorafleet.v1.ControllerService/RegisterReplica"
REGISTER_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ReplicaSettings:
    """Where the controller is and how this replica is reached; read with the service's prefix
    (`LORAFLEET_TRAINER_CONTROLLER_ADDRESS`, `LORAFLEET_ROLLOUT_CONTROLLER_ADDRESS`, ...)."""

    controller_address: str = setting(
        "", doc="host:port of the controller to register with; empty = do not register."
    )
    advertise_address: str = setting(
        "", doc="host:port the controller should dial; empty = 127.0.0.1:<port>."
    )
    register_interval_seconds: float = setting(
        5.0, doc="How often to (re-)register with the controller.", min=0.5, max=3600.0
    )

    def address(self, port: int) -> str:
        return self.advertise_address or f"127.0.0.1:{port}"


class Registrar:
    """Registers `request()` with the controller now and every interval until stopped.

    `request` is called for every heartbeat, so a replica can report what changed (a rollout's
    loaded adapters) without a separate RPC.
    """

    def __init__(
        self,
        settings: ReplicaSettings,
        request: Callable[[], controller_pb2.RegisterReplicaRequest],
    ) -> None:
        self.settings = settings
        self.request = request
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self.settings.controller_address and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="register-replica")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _outage(self, state: RetryCallState) -> None:
        if not self._failing:
            # The controller's answer, when it gave one: a refusal (this replica's quantization
            # differs from its model's, say) is then read in this replica's own log.
            error = state.outcome.exception() if state.outcome is not None else None
            why = error.details() if isinstance(error, grpc.aio.AioRpcError) else None
            log.warning(
                "cannot register with the controller at %s (%s); retrying",
                self.settings.controller_address,
                why or "unreachable",
            )
        self._failing = True

    async def _loop(self) -> None:
        address = self.settings.controller_address
        interval = self.settings.register_interval_seconds
        channel = make_channel(address, idempotent_methods=(REGISTER_METHOD,))
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(grpc.aio.AioRpcError),
            wait=wait_exponential(multiplier=0.1, max=interval),
            before_sleep=self._outage,
        )
        try:
            while True:
                async for attempt in retrying:
                    with attempt:
                        reply = await stub.RegisterReplica(
                            self.request(), timeout=REGISTER_TIMEOUT_SECONDS
                        )
                if self._failing:
                    log.info("registered with the controller at %s again", address)
                self._failing = False
                asked = reply.heartbeat_interval_seconds
                await asyncio.sleep(min(interval, asked) if asked > 0 else interval)
        finally:
            await channel.close()
