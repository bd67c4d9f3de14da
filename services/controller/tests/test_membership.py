"""Discovery feeding the registry, and leader election gating dispatch, in-process.

The Kubernetes API is the recorded-response server of test_discovery.py; Redis is real; the
"trainer" at 127.0.0.1:1 refuses connections, so a dispatched operation stays CLAIMED (in
doubt: never reported failed while the trainer may have it), which is how these tests see
that (and when) something dispatched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet.testing import RedisServer, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.controller import Controller
from lorafleet_controller.discovery import KubernetesDiscovery, LeaderElector
from lorafleet_controller.registry import Registry, Replica
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import OpState, RegState, Store, connect

from .test_discovery import FAST, LEASE, NS, SERVICES, FakeApiServer, wait_until

K = controller_pb2
TRAINER_0 = "rel-lorafleet-trainer-0"


@pytest.fixture
def settings(redis_server: RedisServer, tmp_path: Path) -> ControllerSettings:
    return ControllerSettings(
        redis_url=redis_server.url,
        storage_root=tmp_path / "storage",
        transport_retry_seconds=0,
        heartbeat_timeout_seconds=3600,
        sweep_interval_seconds=0.05,
        coalesce_window_ms=0,
    )


@pytest.fixture
async def registry(settings: ControllerSettings) -> AsyncIterator[Registry]:
    client = connect(settings.redis_url)
    yield Registry(Store(client, settings.key_prefix, settings.ledger_groups), settings)
    await client.aclose()


async def bound_registration(
    registry: Registry, replica: str, address: str, model_seq_id: int = 0
) -> str:
    """A READY registration on a trainer that registered itself (as RegisterReplica does)."""
    await registry.register_replica(Replica("trainer", replica, address, "tiny", 4, "inc", 0, True))
    rec, _ = await registry.create(
        "t", "s1", model_seq_id, "tiny", common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    placement = await registry.place(rec.registration_id)
    assert placement.code == "placed"
    assert await registry.bound(rec.registration_id, placement.replica, placement.slot)
    return rec.registration_id


async def test_a_vanished_trainer_endpoint_loses_its_registrations_at_once(
    apiserver: FakeApiServer, settings: ControllerSettings, registry: Registry
) -> None:
    apiserver.lists.append("endpointslices-list.json")  # trainer-0 ready
    apiserver.watches.append("endpointslices-watch-trainer-lost.jsonl")  # ... then terminating
    rid = await bound_registration(registry, TRAINER_0, "10.244.1.17:50052")
    controller = Controller(
        settings, discovery=KubernetesDiscovery(apiserver.api_client(), NS, SERVICES)
    )
    await controller.start()
    try:
        # an op behind a gap: queued, never dispatched; the loss leaves it queued
        blocked = await controller.ledger.submit("t", rid, 2, 2, b"", "d")

        async def state() -> RegState:
            rec = await registry.get_any(rid)
            assert rec is not None
            return rec.state

        async def lost() -> bool:  # by discovery: heartbeats would take an hour
            return await state() == RegState.UNAVAILABLE

        await wait_until_async(lost, "the run UNAVAILABLE once its trainer left discovery")
        rec = await registry.get_any(rid)
        assert rec is not None and "left discovery" in rec.unavailable_reason
        assert rec.queue_position == 1  # re-queued ahead of new registrations
        op = await controller.ledger.get("t", blocked.operation_id)
        assert op.state == OpState.QUEUED  # kept for after the rebuild (recovery.py)
        assert not (await registry.replica(TRAINER_0)).healthy  # type: ignore[union-attr]
    finally:
        await controller.stop()


async def until_claimed(controller: Controller, opid: str) -> None:
    async def claimed() -> bool:
        return (await controller.ledger.get("t", opid)).state == OpState.CLAIMED

    await wait_until_async(claimed, f"{opid} claimed")


def optim(lr: float = 0.01) -> bytes:
    payload = K.OperationPayload(optim_step=common_pb2.AdamParams(learning_rate=lr))
    return payload.SerializeToString()


async def test_only_the_lease_holder_dispatches(
    apiserver: FakeApiServer, settings: ControllerSettings, registry: Registry
) -> None:
    rid = await bound_registration(registry, "trainer-x", "127.0.0.1:1")
    other_rid = await bound_registration(registry, "trainer-x", "127.0.0.1:1", 1)
    controllers: list[Controller] = []
    electors: list[LeaderElector] = []
    for i, who in enumerate(("a", "b")):
        c = Controller(settings, is_leader=lambda i=i: electors[i].is_leader)
        e = LeaderElector(
            apiserver.api_client(who),
            NS,
            LEASE,
            who,
            on_started_leading=c.start_leading,
            on_stopped_leading=c.stop_leading,
            **FAST,
        )
        controllers.append(c)
        electors.append(e)
    for c in controllers:
        await c.start(lead=False)
    tasks: list[asyncio.Task[None]] = []
    try:
        # No lease yet: nobody dispatches, the operation waits.
        first = await controllers[0].ledger.submit("t", rid, 1, 3, optim(), "d1")
        await asyncio.sleep(0.3)
        assert (await controllers[0].ledger.get("t", first.operation_id)).state == OpState.QUEUED
        tasks += [asyncio.create_task(e.run()) for e in electors]
        await wait_until(lambda: any(c.leading for c in controllers))
        leader = next(i for i, c in enumerate(controllers) if c.leading)
        other = 1 - leader
        assert not controllers[other]._loops  # the standby runs no loop at all
        # The leader claims and dispatches it (its trainer is unreachable: it stays CLAIMED,
        # in doubt, never reported failed).
        await until_claimed(controllers[0], first.operation_id)

        # Cut the leader off the API server: it stops dispatching by its renew deadline,
        # and the other takes over (only) after the lease duration.
        apiserver.blocked.add(electors[leader].identity)
        await wait_until(lambda: not controllers[leader]._loops)
        assert not electors[leader].is_leader
        # (rid's next op waits behind the first, in doubt: a second run shows the takeover)
        second = await controllers[0].ledger.submit("t", other_rid, 1, 3, optim(), "d2")
        await wait_until(lambda: controllers[other].leading)
        await until_claimed(controllers[0], second.operation_id)
        assert not controllers[leader]._loops
    finally:
        apiserver.blocked.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in controllers:
            await c.stop()
    writes = [who for who, _ in apiserver.lease_writes]
    assert set(writes) == {"a", "b"}
    assert apiserver.lease["spec"].get("holderIdentity") is None  # released on the way out


@pytest.fixture
def apiserver():
    with FakeApiServer() as server:
        yield server
