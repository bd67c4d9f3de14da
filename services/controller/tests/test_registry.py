"""Slot placement against a real redis-server: queueing, release, replica loss."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.registry import Placement, Replica
from lorafleet_controller.store import OpState, RegState
from lorafleet_controller.store.registrations import RESERVATION_GRACE_SECONDS

from .conftest import Domain


async def add_trainer(d: Domain, name: str, slots: int, inc: str = "a") -> str:
    return await d.registry.register_replica(
        Replica("trainer", name, f"127.0.0.1:{slots}", "base", slots, inc, 0, True, max_rank=8)
    )


async def create(d: Domain, seq: int, tenant: str = "t1") -> str:
    rec, created = await d.registry.create(
        tenant, "s", seq, "base", common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    assert created
    return rec.registration_id


async def test_full_pool_queues_instead_of_evicting(domain: Domain) -> None:
    await add_trainer(domain, "tr-a", 1)
    await add_trainer(domain, "tr-b", 1)
    placed = []
    for seq in range(4):
        placed.append(await domain.registry.place(await create(domain, seq)))
    assert {p.replica for p in placed[:2]} == {"tr-a", "tr-b"}  # spread over replicas
    assert placed[2] == Placement("queued", position=1)
    assert placed[3] == Placement("queued", position=2)
    rec = await domain.registry.get("t1", "s:train:3")
    assert rec.state == RegState.QUEUED and rec.queue_position == 2
    # ops for a queued registration wait; they are not dispatched
    adm = await domain.ledger.submit("t1", "s:train:3", 1, 2, b"x", "d")
    assert (await domain.ledger.get("t1", adm.operation_id)).waiting_reason == "waiting for a slot"
    # releasing a slot lets the queue head in, in arrival order
    first = placed[0]
    replica, slot, _ = await domain.registry.release("s:train:0")
    assert (replica, slot) == (first.replica, first.slot)
    assert await domain.registry.place("s:train:2") == Placement("placed", replica, slot)
    assert (await domain.registry.get("t1", "s:train:3")).queue_position == 1


async def test_idempotent_create_and_tenancy(domain: Domain) -> None:
    await add_trainer(domain, "tr-a", 2)
    rid = await create(domain, 0)
    again, created = await domain.registry.create(
        "t1", "s", 0, "base", common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    assert not created and again.registration_id == rid
    try:
        await domain.registry.get("t2", rid)
    except errors.NotFound as exc:
        assert exc.field == "registration_id"
    else:
        raise AssertionError("another tenant saw the registration")


async def test_replica_loss_requeues_open_ops_and_the_run_first(domain: Domain) -> None:
    await add_trainer(domain, "tr-a", 1)
    rid = await create(domain, 0)
    placement = await domain.registry.place(rid)
    assert placement.code == "placed"
    assert await domain.registry.bound(rid, placement.replica, placement.slot)
    newcomer = await create(domain, 1)
    assert (await domain.registry.place(newcomer)).code == "queued"
    a = await domain.ledger.submit("t1", rid, 1, 2, b"a", "da")
    b = await domain.ledger.submit("t1", rid, 2, 2, b"b", "db")
    await domain.ledger.claim(a.operation_id)
    # the trainer comes back with a new incarnation: its slots are gone
    assert await add_trainer(domain, "tr-a", 1, inc="b") == "restarted"
    rec = await domain.registry.get("t1", rid)
    assert rec.state == RegState.UNAVAILABLE and "new incarnation" in rec.unavailable_reason
    # nothing fails: the claimed op is queued again, to run after the run is rebuilt
    for opid in (a.operation_id, b.operation_id):
        op = await domain.ledger.get("t1", opid)
        assert op.state == OpState.QUEUED and op.error is None
    assert await domain.ledger.claimed_ids() == []
    try:
        await domain.ledger.submit("t1", rid, 3, 2, b"c", "dc")
    except errors.Unavailable as exc:
        assert "new incarnation" in exc.message
    else:
        raise AssertionError("an unavailable registration admitted an op")
    # the lost registration is rebound before the newcomer
    assert (await domain.registry.queued("base"))[0] == rid
    placement = await domain.registry.place(rid)
    assert placement.code == "placed"
    assert (await domain.registry.get("t1", rid)).restore
    assert await domain.registry.bound(rid, placement.replica, placement.slot)
    adm = await domain.ledger.submit("t1", rid, 3, 2, b"c", "dc")
    assert adm.state == OpState.QUEUED


async def test_a_loss_cut_off_after_its_first_step_is_finished_by_the_next(
    domain: Domain,
) -> None:
    """Losing a trainer marks it unhealthy, then loses each slot entry in its run's group. A
    controller that died between the steps left the entries: the next loss (the sweeper's
    redrive of an unhealthy trainer with slots) finishes them, and a third changes nothing."""
    await add_trainer(domain, "tr-a", 4)
    rids = [await create(domain, i) for i in range(3)]
    for rid in rids:
        placement = await domain.registry.place(rid)
        assert await domain.registry.bound(rid, placement.replica, placement.slot)
    store = domain.store
    await store.scripts.run(  # the first step alone
        "replica_lost", [store.keys.replica("tr-a")], "tr-a", epoch=store.epoch
    )
    assert not (await domain.registry.replica("tr-a")).healthy
    assert {(await domain.registry.get("t1", r)).state for r in rids} == {RegState.READY}
    assert sorted(await domain.registry.replica_lost("tr-a", "gone")) == sorted(rids)
    for rid in rids:
        rec = await domain.registry.get("t1", rid)
        assert rec.state == RegState.UNAVAILABLE and rec.replica == "" and rec.restore
    assert await domain.registry.slot_table("tr-a") == {}
    assert sorted(await domain.registry.queued("base")) == sorted(rids)
    assert await domain.registry.replica_lost("tr-a", "gone") == []


async def test_a_creation_cut_off_between_its_steps_is_finished_or_undone(
    domain: Domain,
) -> None:
    """Creating reserves the id for its tenant (fleet), writes the record (its group), then
    drops the reservation. A reservation left by a creator that died: kept by the sweep when
    the record exists, undone when it never came, so the tenant's limit is not held by a run
    that does not exist; a fresher reservation is left alone."""
    store, regs = domain.store, domain.registry.regs
    keys = store.keys
    live = await create(domain, 0)
    await store.redis.hset(keys.reserving, live, '{"tenant": "t1", "session": "s", "at": 0}')
    for rid, at in (("s:train:7", 0), ("s:train:8", domain.clock.now)):  # died after step 1
        await store.scripts.run(
            "reg_reserve", [store.keys.tenant_live("t1")], rid, "t1", "s", at, 10
        )
    assert await regs.live_count("t1") == 3
    domain.clock.now += RESERVATION_GRACE_SECONDS - 1
    assert await domain.registry.sweep_reservations() == 1  # s:train:7 only
    assert await regs.live_count("t1") == 2
    assert set(await domain.registry.all_ids()) == {live, "s:train:8"}
    assert await domain.registry.get("t1", live)  # its reservation was kept, then dropped
    assert sorted(await store.redis.hkeys(keys.reserving)) == [b"s:train:8"]
    domain.clock.now += RESERVATION_GRACE_SECONDS
    assert await domain.registry.sweep_reservations() == 1
    assert await regs.live_count("t1") == 1
    # the one retired leaves its tenant's live runs once, however often it is retired
    await domain.registry.release(live)
    await domain.registry.release(live)
    assert await regs.live_count("t1") == 0


async def test_placements_cut_off_between_their_steps_are_repaired(domain: Domain) -> None:
    """A placement is a fleet step (the slot) then the run's group step (it takes the slot);
    a release the group's step then the fleet's. Cut off between them, the slot entry is
    left to a run that does not hold it: the repair (two sweeps in a row) revokes the
    placement in the run's group, so it can no longer be taken, and frees the slot."""
    store, registry = domain.store, domain.registry
    await add_trainer(domain, "tr-a", 2)
    placed, released = await create(domain, 0), await create(domain, 1)
    regq = [store.keys.regq("base")]
    out = await store.scripts.run("place", regq, placed, "t1", "base", 0, 0)  # fleet step only
    slot = int(dict(zip(out[::2], out[1::2], strict=True))[b"slot"])
    p = await registry.place(released)
    assert await registry.bound(released, p.replica, p.slot)
    await store.scripts.run(  # the group step of a release only
        "release", [store.keys.reg(released)], released, group=store.keys.group_of(released)
    )
    assert await registry.slot_table("tr-a") == {slot: placed, p.slot: released}
    await registry.repair_placements()  # first sight: a change may be in flight
    assert len(await registry.slot_table("tr-a")) == 2
    await registry.repair_placements()
    assert await registry.slot_table("tr-a") == {}
    # the revoked placement can no longer be taken; a new one works
    assert (
        await store.scripts.run(
            "accept_place",
            [store.keys.reg(placed)],
            placed,
            "tr-a",
            slot,
            0,
            group=store.keys.group_of(placed),
        )
    )[1] == b"moved"
    again = await registry.place(placed)
    assert again.code == "placed"
    assert await registry.bound(placed, again.replica, again.slot)
    await registry.repair_placements()
    await registry.repair_placements()
    assert await registry.slot_table("tr-a") == {again.slot: placed}  # held: left alone


async def test_a_run_retired_in_its_group_only_leaves_its_tenants_live_runs(
    domain: Domain,
) -> None:
    """Retiring is the group's change (a fence), then the fleet's (release: out of the
    tenant's live runs). Cut off between them, the repair takes it out."""
    rid = await create(domain, 0)
    gone = errors.FailedPrecondition("gone", reason="RETIRED")
    await domain.ledger.fence(rid, RegState.RETIRED, gone)
    assert await domain.registry.regs.live_count("t1") == 1  # the fleet's step is next
    await domain.registry.repair_placements()
    assert await domain.registry.regs.live_count("t1") == 0


async def test_heartbeat_silence_is_detected(domain: Domain) -> None:
    await add_trainer(domain, "tr-a", 1)
    assert await domain.registry.silent_replicas(5) == []
    domain.clock.now += 6
    assert [r.replica_id for r in await domain.registry.silent_replicas(5)] == ["tr-a"]


async def test_an_announcement_reports_what_changed_and_a_failure_needs_a_replica(
    domain: Domain,
) -> None:
    """replica_register.lua classifies an announcement in the step that records it;
    replica_failed.lua writes only on a known replica."""
    assert await add_trainer(domain, "tr-a", 2) == "new"
    assert await add_trainer(domain, "tr-a", 2) == "same"
    assert await domain.registry.replicas("trainer", "base") == [
        await domain.registry.replica("tr-a")
    ]
    with pytest.raises(errors.NotFound):
        await domain.registry.replica_failed("tr-x", "gave up")
    assert await domain.registry.replica("tr-x") is None  # no record made for it
    rep = await domain.registry.replica_failed("tr-a", "gave up after 5 restarts")
    assert rep.kind == "trainer" and rep.base_model == "base"
    failed = await domain.registry.replica("tr-a")
    assert failed is not None and not failed.healthy and failed.failed.startswith("gave up")
    assert await add_trainer(domain, "tr-a", 2) == "returned"
    back = await domain.registry.replica("tr-a")
    assert back is not None and back.healthy and back.failed == ""
