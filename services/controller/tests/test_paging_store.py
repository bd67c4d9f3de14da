"""Paging's store side on real Redis (one server and a Cluster): the fenced transitions, the
per-tenant slot cap, the page-in queue and the choice of idle runs to page out."""

from __future__ import annotations

from typing import Any

from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.paging import Pager
from lorafleet_controller.registry import Replica
from lorafleet_controller.store import RegState, named, text

from .conftest import Domain

FB = controller_pb2.OPERATION_KIND_FORWARD_BACKWARD


async def run(d: Domain, script: str, rid: str, *args: Any) -> dict[str, Any]:
    group = d.store.keys.group_of(rid)
    return named(
        await d.store.scripts.run(script, [d.store.keys.reg(rid)], rid, *args, group=group)
    )


async def create(d: Domain, tenant: str, seq: int) -> str:
    rec, _ = await d.registry.create(
        tenant, f"s-{tenant}", seq, "tiny", common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    return rec.registration_id


async def test_capped_tenants_wait_and_idle_runs_page_out_and_back_in(domain: Domain) -> None:
    d = await domain.restart(max_slots_per_tenant=1, page_idle_seconds=5.0)
    trainer = Replica("trainer", "tr", "127.0.0.1:1", "tiny", 2, "i", 0, True)
    await d.registry.register_replica(trainer)
    a1, a2, b1 = await create(d, "A", 0), await create(d, "A", 1), await create(d, "B", 0)
    placed = await d.registry.place(a1)
    assert placed.code == "placed"
    assert (await d.registry.place(a2)).code == "capped"  # a slot is free, but A holds its 1
    assert (await d.registry.place(b1)).code == "placed"
    for rid in (a1, b1):
        rec = await d.registry.get_any(rid)
        assert rec is not None and await d.registry.bound(rid, rec.replica, rec.slot)

    # b1 has been idle longest, but a2's tenant is at its cap: only A's own idle run may go.
    now = d.clock.now
    await d.client.hset(d.store.keys.reg(a1), "last_done", now - 10)
    await d.client.hset(d.store.keys.reg(b1), "last_done", now - 20)
    pager = Pager(d.registry, None, None, None, d.settings, d.clock)  # type: ignore[arg-type]
    assert await pager._victims("tiny") == [a1]
    await d.client.hset(d.store.keys.reg(a1), "last_done", now - 1)  # active within 5 s
    assert await pager._victims("tiny") == []

    # An idle page-out of a run with work open is refused; a forced one waits for nothing.
    await d.ledger.submit("A", a1, 1, FB, b"x", "d1")
    assert text((await run(d, "page_begin", a1, "tr", placed.slot, now - 5))["code"]) == "busy"
    begun = await run(d, "page_begin", a1, "tr", placed.slot, 0)
    assert text(begun["code"]) == "ok" and int(begun["seq"]) == 0 and int(begun["pending"]) == 1
    assert (await d.registry.get_any(a1)).state == RegState.PAGING  # type: ignore[union-attr]
    assert await d.ledger.claim(f"{a1}#1") is None  # a paging run's head is claimed by nobody
    ended = await run(d, "page_end", a1, now + 1)
    assert text(ended["code"]) == "paged" and int(ended["waiting"]) == 1  # its op waits
    assert await d.registry.slot_table("tr") == {0: a1, 1: b1}  # the fleet's step is next
    d.clock.now = now + 1  # paged out after a2 started waiting
    await d.registry.paged_out(a1, "tr", placed.slot, "tiny", True)
    rec = await d.registry.get_any(a1)
    assert rec is not None and rec.state == RegState.PAGED and rec.restore and rec.slot == -1
    assert not [g for g in d.store.keys.all_groups() if await d.client.smembers(g.paging)]
    # Its slot goes to the capped run, oldest waiting first; the paged run queues behind it.
    assert await d.registry.queued("tiny") == [a2, a1]
    assert (await d.registry.place(a2)).code == "placed"
    assert (await d.registry.place(a1)).code == "capped"
    assert (await d.registry.get_any(a1)).state == RegState.PAGED  # type: ignore[union-attr]


async def test_submitting_to_a_paged_run_queues_it_and_an_abort_makes_it_ready(
    domain: Domain,
) -> None:
    d = domain
    rid = await d.ready_registration()
    rec = await d.registry.get_any(rid)
    assert rec is not None
    assert text((await run(d, "page_begin", rid, rec.replica, rec.slot, 0))["code"]) == "ok"
    assert text((await run(d, "page_abort", rid, d.clock.now))["code"]) == "ready"
    assert (await d.registry.get_any(rid)).state == RegState.READY  # type: ignore[union-attr]
    assert text((await run(d, "page_abort", rid, d.clock.now))["code"]) == "moved"

    assert text((await run(d, "page_begin", rid, rec.replica, rec.slot, 0))["code"]) == "ok"
    assert int((await run(d, "page_end", rid, d.clock.now))["waiting"]) == 0
    assert await d.registry.queued(rec.base_model) == []  # no work, no page-in
    d.clock.now += 1
    admitted = await d.ledger.submit(rec.tenant, rid, 1, FB, b"x", "d1")
    assert admitted.page_in == rec.base_model
    await d.registry.wait_for_slot(rid, admitted.page_in)  # what the operations flow does
    assert await d.registry.queued(rec.base_model) == [rid]
    assert await d.client.zscore(d.store.keys.regq(rec.base_model), rid) == d.clock.now
    placed = await d.registry.place(rid)
    assert placed.code == "placed"
    assert await d.registry.bound(rid, placed.replica, placed.slot)
    after = await d.registry.get_any(rid)
    assert after is not None and after.state == RegState.READY and not after.paged_at
