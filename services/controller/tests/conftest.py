"""Fixtures for the controller's domain tests: a real redis-server and the domain objects."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from lorafleet.testing import RedisServer
from lorafleet.v1 import common_pb2
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.lua import Scripts
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry, Replica
from lorafleet_controller.settings import ControllerSettings


class Clock:
    """A settable clock, so TTL and timeout tests need no sleeps."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Domain:
    client: aioredis.Redis
    settings: ControllerSettings
    ledger: Ledger
    registry: Registry
    notifier: Notifier
    clock: Clock

    async def ready_registration(
        self, tenant: str = "t1", session: str = "s1", seq: int = 0, base: str = "tiny"
    ) -> str:
        """A READY registration on a replica record (the trainer side is not involved)."""
        await self.registry.register_replica(
            Replica("trainer", f"tr-{base}", "127.0.0.1:1", base, 64, "inc", 0, True)
        )
        rec, _ = await self.registry.create(
            tenant, session, seq, base, common_pb2.LoraConfig(rank=4), {}, "adamw", False
        )
        code, replica, slot = await self.registry.place(rec.registration_id)
        assert code == "placed"
        assert await self.registry.bound(rec.registration_id, replica, slot)
        return rec.registration_id

    async def restart(self, **overrides: Any) -> Domain:
        """A fresh set of domain objects on the same Redis (a controller restart)."""
        await self.notifier.stop()
        return await build(self.client, dataclasses.replace(self.settings, **overrides),
                           self.clock)  # fmt: skip


async def build(client: aioredis.Redis, settings: ControllerSettings, clock: Clock) -> Domain:
    scripts = Scripts(client, settings.key_prefix)
    notifier = Notifier(client, settings.key_prefix)
    await notifier.start()
    ledger = Ledger(client, scripts, settings, notifier, clock)
    registry = Registry(client, scripts, settings.key_prefix, clock)
    return Domain(client, settings, ledger, registry, notifier, clock)


@pytest.fixture
async def domain(redis_server: RedisServer) -> AsyncIterator[Domain]:
    client = aioredis.from_url(redis_server.url)
    settings = ControllerSettings(
        redis_url=redis_server.url, max_pending_per_registration=8, max_unacked_results=20,
        max_pending_global=50, gap_timeout_seconds=5, claimed_timeout_seconds=10,
        result_ttl_seconds=100,
    )  # fmt: skip
    d = await build(client, settings, Clock())
    try:
        yield d
    finally:
        await d.notifier.stop()
        await client.aclose()
