"""Room in Redis (store/room.py): new work is refused before the server reaches maxmemory,
while what frees room goes on; an evicting server is refused at start (issue 36 item 4)."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.store import OpState
from lorafleet_controller.store.room import STORE_FULL, Room

from .conftest import Domain
from .test_ledger import pop_ready, run_one, submit


async def set_limit(d: Domain, maxmemory: int) -> None:
    """Change the server's maxmemory and take a reading (the controller's loop would)."""
    await d.store.redis.config_set("maxmemory", maxmemory)
    await d.store.room.refresh()


async def used(d: Domain) -> int:
    return (await d.store.room.refresh()).used


@pytest.mark.parametrize("redis_url", ["redis"], indirect=True)
async def test_new_work_is_refused_before_maxmemory_and_resumes_after(domain: Domain) -> None:
    d = domain
    rid = await d.ready_registration()
    first = await submit(d, rid, 1, b"a")
    # A limit the server is already past 92% of (full from 90%): admission refuses before
    # writing, with room left for what frees it.
    await set_limit(d, int(await used(d) / 0.92))
    before = await d.client.dbsize()
    with pytest.raises(errors.ResourceExhausted) as full:
        await submit(d, rid, 2, b"b")
    assert full.value.reason == STORE_FULL and full.value.field == "store"
    assert full.value.retry_after >= 1.0
    with pytest.raises(errors.ResourceExhausted):
        await d.registry.create(
            "t1", "s2", 0, "tiny", common_pb2.LoraConfig(rank=4), {}, "adamw", False
        )
    assert await d.client.dbsize() == before  # nothing was written
    # What finishes and frees work goes on: the open operation completes, is acknowledged.
    await run_one(d, (await pop_ready(d))[-1])
    await d.ledger.ack("t1", first.operation_id)
    assert (await d.ledger.get("t1", first.operation_id)).state == OpState.SUCCEEDED
    await set_limit(d, 0)  # room again (no limit): admitted, in order
    assert (await submit(d, rid, 2, b"b")).state == OpState.QUEUED


@pytest.mark.parametrize("redis_url", ["redis"], indirect=True)
async def test_a_server_that_evicts_is_refused(domain: Domain) -> None:
    room = Room(domain.store.redis)
    reading = await room.verify()  # the private servers: bounded, noeviction
    assert reading.limit > 0 and reading.policy == "noeviction"
    await domain.store.redis.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(errors.FailedPrecondition, match="allkeys-lru"):
        await room.verify()
