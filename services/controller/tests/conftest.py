"""Fixtures for the controller's domain tests: real Redis (one server, or a 3-master Redis
Cluster) and the domain objects on it."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from lorafleet.v1 import common_pb2
from lorafleet_controller.ledger import Claim, Ledger
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry, Replica
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import Client, Store, connect


class Clock:
    """A settable clock, so TTL and timeout tests need no sleeps."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Domain:
    store: Store
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
        placement = await self.registry.place(rec.registration_id)
        assert placement.code == "placed"
        assert await self.registry.bound(rec.registration_id, placement.replica, placement.slot)
        return rec.registration_id

    async def claim_ready(self, limit: int) -> list[Claim]:
        """Claim what is ready in every group, up to `limit` claims, group after group (what
        the scheduler's claimers do together)."""
        claims: list[Claim] = []
        for group in range(self.store.keys.groups):
            if len(claims) >= limit:
                break
            claims += await self.ledger.claim_many(group, [], limit - len(claims))
        return claims

    async def ready_ids(self) -> list[str]:
        """The ids in every group's ready lists (data, then control), taken out of them."""
        ids: list[str] = []
        for keys in self.store.keys.all_groups():
            for ready in (keys.ready_data, keys.ready_ctl):
                ids += [x.decode() for x in await self.client.lrange(ready, 0, -1)]
                await self.client.delete(ready)
        return ids

    @property
    def client(self) -> Client:
        return self.store.redis

    # Every domain restarted from this one, so the fixture stops their notifiers before it
    # closes the client: one left subscribed hung the event loop's teardown on a Cluster
    # pubsub's close (CI spent test_concurrent_submits_share_one_round_trip's 600 s there).
    restarted: list[Domain] = dataclasses.field(default_factory=list)

    async def restart(self, **overrides: Any) -> Domain:
        """A fresh set of domain objects on the same Redis (a controller restart)."""
        await self.notifier.stop()
        fresh = await build(
            self.store.redis, dataclasses.replace(self.settings, **overrides), self.clock
        )
        self.restarted.append(fresh)
        return fresh

    async def stop(self) -> None:
        """Stop this domain's notifier and those of every domain restarted from it."""
        for child in self.restarted:
            await child.stop()
        await self.notifier.stop()


async def build(client: Client, settings: ControllerSettings, clock: Clock) -> Domain:
    """The domain objects of one controller that dispatches (it holds the newest epoch)."""
    store = Store(client, settings.key_prefix, settings.ledger_groups)
    await store.take_epoch()
    notifier = Notifier(store)
    await notifier.start()
    ledger = Ledger(store, settings, notifier, clock)
    registry = Registry(store, settings, clock)
    return Domain(store, settings, ledger, registry, notifier, clock)


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """(url, cluster): every domain test runs on one redis-server and on a 3-master Cluster."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url, True
    return request.getfixturevalue("redis_server").url, False


# The domain runs in 8 groups (store/keys.py): on one redis-server every transition is
# checked to stay in its call's group (CROSSGROUP), on the 3-master Cluster the groups
# spread over the masters. The fleet tests (tests/fleet.py) run the default, 1.
GROUPS = 8


@pytest.fixture
async def domain(redis_url: tuple[str, bool]) -> AsyncIterator[Domain]:
    url, cluster = redis_url
    settings = ControllerSettings(
        redis_url=url,
        redis_cluster=cluster,
        ledger_groups=GROUPS,
        max_pending_per_registration=8,
        max_unacked_results=20,
        max_unacked_results_per_tenant=20,
        max_pending_global=50,
        max_pending_per_tenant=50,
        gap_timeout_seconds=5,
        claimed_timeout_seconds=10,
        result_ttl_seconds=100,
        acked_result_grace_seconds=30,  # shorter than the TTL, so the ack is what releases
    )
    client = connect(url, cluster=cluster)
    d = await build(client, settings, Clock())
    try:
        yield d
    finally:
        await d.stop()
        await client.aclose()
