"""Ledger semantics against a real redis-server: ordering, idempotency, gaps, backpressure."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet import errors
from lorafleet_controller import ledger as L
from lorafleet_controller.registry import Replica
from lorafleet_controller.store import OpState, RegState, Store, connect

from .conftest import Domain

FB = 2  # OPERATION_KIND_FORWARD_BACKWARD
OPT = 3


async def submit(d: Domain, rid: str, seq: int, payload: bytes = b"p", kind: int = FB, **kw):
    return await d.ledger.submit("t1", rid, seq, kind, payload, f"d:{payload!r}", **kw)


async def pop_ready(d: Domain) -> list[str]:
    return await d.ready_ids()


async def run_one(d: Domain, opid: str, result: bytes = b"ok") -> None:
    claim = await d.ledger.claim(opid)
    assert claim is not None, opid
    assert await d.ledger.complete(opid, OpState.SUCCEEDED, result)


async def test_out_of_order_arrivals_run_in_seq_order(domain: Domain) -> None:
    rid = await domain.ready_registration()
    for seq in (3, 2):
        adm = await submit(domain, rid, seq, b"x%d" % seq)
        assert adm.state == OpState.QUEUED and not adm.duplicate
    assert await pop_ready(domain) == []
    rec = await domain.ledger.get("t1", L.operation_id(rid, 3))
    assert rec.waiting_reason == "waiting for seq_id 1"
    await submit(domain, rid, 1, b"x1")
    order = []
    for _ in range(3):
        ready = await pop_ready(domain)
        assert len(ready) == 1  # strictly serial per registration
        order += ready
        if not ready[0].endswith("#3"):  # nothing but the head is claimable
            assert await domain.ledger.claim(L.operation_id(rid, 3)) is None
        await run_one(domain, ready[0])
    assert order == [L.operation_id(rid, s) for s in (1, 2, 3)]


async def test_retry_is_idempotent_and_conflict_is_refused(domain: Domain) -> None:
    rid = await domain.ready_registration()
    first = await submit(domain, rid, 1, b"same")
    again = await submit(domain, rid, 1, b"same")
    assert again.duplicate and again.operation_id == first.operation_id
    with pytest.raises(errors.Conflict) as exc:
        await submit(domain, rid, 1, b"other")
    assert exc.value.field == "seq_id"
    assert await pop_ready(domain) == [first.operation_id]  # queued once


async def test_invalid_seq_ids_and_payload_size(domain: Domain) -> None:
    rid = await domain.ready_registration()
    for bad in (0, -1, 1 + domain.ledger.window):
        with pytest.raises(errors.InvalidArgument) as exc:
            await submit(domain, rid, bad)
        assert exc.value.field == "seq_id"
    with pytest.raises(errors.InvalidArgument) as exc:
        await submit(domain, rid, 1, b"x" * (domain.settings.max_payload_bytes + 1))
    assert exc.value.field == "payload"
    assert (await domain.registry.get("t1", rid)).max_seq == 0  # nothing consumed
    with pytest.raises(errors.NotFound):
        await domain.ledger.submit("other-tenant", rid, 1, FB, b"p", "d")


async def test_born_terminal_record_consumes_seq(domain: Domain) -> None:
    rid = await domain.ready_registration()
    bad = errors.InvalidArgument("lr is nan", field="adam_params.learning_rate")
    adm = await submit(domain, rid, 1, b"bad", kind=OPT, rejection=bad)
    assert adm.state == OpState.FAILED
    rec = await domain.ledger.get("t1", adm.operation_id)
    assert rec.error["field"] == "adam_params.learning_rate"
    assert rec.error["category"] == "user"
    adm2 = await submit(domain, rid, 2, b"good")
    assert await pop_ready(domain) == [adm2.operation_id]  # seq 1 never blocks seq 2


async def test_backpressure_before_consumption_and_hole_filling(domain: Domain) -> None:
    rid = await domain.ready_registration()
    limit = domain.settings.max_pending_per_registration
    for seq in range(2, limit + 2):  # seq 1 missing: a gap at the head
        await submit(domain, rid, seq, b"%d" % seq)
    with pytest.raises(errors.InvalidArgument):  # beyond the window
        await submit(domain, rid, domain.ledger.window + 1)
    reg = await domain.registry.get("t1", rid)
    assert reg.pending == limit
    # the hole-filling seq_id is admitted although the registration is at its limit
    adm = await submit(domain, rid, 1, b"1")
    assert adm.state == OpState.QUEUED
    await run_one(domain, (await pop_ready(domain))[0])
    with pytest.raises(errors.ResourceExhausted) as exc:
        await submit(domain, rid, limit + 2, b"late")
    assert exc.value.retry_after > 0
    # refused means not consumed: the same seq_id is admitted once there is room
    await run_one(domain, (await pop_ready(domain))[0])
    adm = await submit(domain, rid, limit + 2, b"late")
    assert not adm.duplicate


async def test_global_and_unacked_limits(domain: Domain) -> None:
    rids = [await domain.ready_registration(session=f"s{i}") for i in range(8)]
    n = 0
    with pytest.raises(errors.ResourceExhausted):
        for i in range(100):
            await submit(domain, rids[i % 8], i // 8 + 1)
            n += 1
    assert n == domain.settings.max_pending_global


async def test_gap_is_sealed_after_timeout(domain: Domain) -> None:
    rid = await domain.ready_registration()
    await submit(domain, rid, 2, b"two")
    await submit(domain, rid, 3, b"three")
    assert await domain.ledger.gap_stalls() == 1
    domain.clock.now += 1
    assert (await domain.ledger.sweep()).gaps_sealed == 0  # not yet
    domain.clock.now += domain.settings.gap_timeout_seconds
    assert (await domain.ledger.sweep()).gaps_sealed == 1
    for seq in (2, 3):
        rec = await domain.ledger.get("t1", L.operation_id(rid, seq))
        assert rec.state == OpState.FAILED
        assert "seq_id 1" in rec.error["message"] and rec.error["reason"] == "SEQ_GAP_SEALED"
    with pytest.raises(errors.Conflict):  # a late arrival is never executed
        await submit(domain, rid, 1, b"one")
    adm = await submit(domain, rid, 4, b"four")
    assert await pop_ready(domain) == [adm.operation_id]
    assert await domain.ledger.gap_stalls() == 0


async def test_claimed_sweeper_and_stale_completion(domain: Domain) -> None:
    rid = await domain.ready_registration()
    a = await submit(domain, rid, 1, b"a")
    b = await submit(domain, rid, 2, b"b")
    assert await domain.ledger.claim(a.operation_id) is not None
    assert await domain.ledger.claim(a.operation_id) is None  # claimed once
    domain.clock.now += domain.settings.claimed_timeout_seconds + 1
    assert (await domain.ledger.sweep()).claims_failed == 1
    rec = await domain.ledger.get("t1", a.operation_id)
    assert rec.state == OpState.FAILED and rec.error["category"] == "server"
    # a late result of the swept claim is not recorded
    assert not await domain.ledger.complete(a.operation_id, OpState.SUCCEEDED, b"late")
    ready = await pop_ready(domain)
    assert b.operation_id in ready


async def test_ack_and_result_expiry_keep_the_seq_reserved(domain: Domain) -> None:
    rid = await domain.ready_registration()
    a = await submit(domain, rid, 1, b"a")
    b = await submit(domain, rid, 2, b"b")
    with pytest.raises(errors.FailedPrecondition):
        await domain.ledger.ack("t1", a.operation_id)
    await run_one(domain, a.operation_id, b"RESULT")
    rec = await domain.ledger.get("t1", a.operation_id)
    assert rec.state == OpState.SUCCEEDED and rec.result == b"RESULT"
    await domain.ledger.ack("t1", a.operation_id)
    # Acknowledged: no longer unacked, but readable for the grace (a lost answer is
    # fetched again), whatever the sweep and a second ack do meanwhile.
    assert (await domain.ledger.tenant_load("t1"))["unacked"] == 0
    await domain.ledger.ack("t1", a.operation_id)
    assert (await domain.ledger.sweep()).results_expired == 0
    rec = await domain.ledger.get("t1", a.operation_id)
    assert rec.state == OpState.SUCCEEDED and rec.result == b"RESULT"
    domain.clock.now += domain.settings.acked_result_grace_seconds + 1
    assert (await domain.ledger.sweep()).results_expired == 1
    rec = await domain.ledger.get("t1", a.operation_id)
    assert rec.state == OpState.EXPIRED and rec.result == b""
    assert (await domain.ledger.tenant_load("t1"))["unacked"] == 0  # not released twice
    # Released below the head: the record is gone (compacted), the head answers for it. A
    # retry is refused as released, never run again.
    assert not await domain.client.exists(domain.store.keys.op(a.operation_id))
    with pytest.raises(errors.Expired) as released:
        await submit(domain, rid, 1, b"a")
    assert released.value.reason == "RESULT_RELEASED"
    with pytest.raises(errors.NotFound):
        await domain.ledger.ack("t2", b.operation_id)
    await run_one(domain, (await pop_ready(domain))[-1])
    domain.clock.now += domain.settings.result_ttl_seconds + 1
    assert (await domain.ledger.get("t1", b.operation_id)).state == OpState.EXPIRED
    assert (await domain.ledger.sweep()).results_expired == 1
    assert (await domain.ledger.fleet_load())["unacked"] == 0
    assert (await domain.ledger.tenant_load("t1"))["unacked"] == 0


async def test_long_poll_wakes_on_completion(domain: Domain) -> None:
    rid = await domain.ready_registration()
    a = await submit(domain, rid, 1, b"a")
    rec = await domain.ledger.wait("t1", a.operation_id, 0.05)
    assert rec.state == OpState.QUEUED
    waiter = asyncio.create_task(domain.ledger.wait("t1", a.operation_id, 10))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await run_one(domain, a.operation_id)
    rec = await waiter
    assert rec.state == OpState.SUCCEEDED and loop.time() - start < 1.0


async def test_fence_fails_open_operations_and_refuses_new(domain: Domain) -> None:
    rid = await domain.ready_registration()
    a = await submit(domain, rid, 1, b"a")
    b = await submit(domain, rid, 3, b"b")
    await domain.ledger.claim(a.operation_id)
    retired = errors.FailedPrecondition("registration retired", reason="RETIRED")
    assert await domain.ledger.fence(rid, RegState.RETIRED, retired) == 2
    for opid in (a.operation_id, b.operation_id):
        rec = await domain.ledger.get("t1", opid)
        assert rec.state == OpState.FAILED and rec.error["reason"] == "RETIRED"
    with pytest.raises(errors.FailedPrecondition):
        await submit(domain, rid, 4, b"c")


async def test_state_survives_a_controller_restart(domain: Domain) -> None:
    rid = await domain.ready_registration()
    a = await submit(domain, rid, 1, b"a")
    await submit(domain, rid, 3, b"c")
    assert await pop_ready(domain) == [a.operation_id]
    await domain.ledger.claim(a.operation_id)
    d2 = await domain.restart()
    assert await d2.ledger.claimed_ids() == [a.operation_id]
    claim = await d2.ledger.load_claim(a.operation_id)
    assert claim is not None and claim.payload == b"a"
    assert (await submit(d2, rid, 1, b"a")).duplicate
    await d2.ledger.complete(a.operation_id, OpState.SUCCEEDED, b"r")
    await submit(d2, rid, 2, b"b")
    ready = await pop_ready(d2)
    assert ready == [L.operation_id(rid, 2)]
    await d2.notifier.stop()


async def test_retired_registrations_lose_their_records_after_the_result_ttl(
    domain: Domain,
) -> None:
    keys = domain.store.keys
    live = await domain.ready_registration(session="s-live")
    kept = await submit(domain, live, 1, b"k")
    rid = await domain.ready_registration(session="s-gone")
    acked, done = await submit(domain, rid, 1, b"a"), await submit(domain, rid, 2, b"b")
    blocked = await submit(domain, rid, 4, b"c")  # behind the missing seq 3
    for opid in await pop_ready(domain):
        await run_one(domain, opid)
    await run_one(domain, (await pop_ready(domain))[0])  # seq 2, after seq 1 finished
    await domain.ledger.ack("t1", acked.operation_id)
    retired = errors.FailedPrecondition("retired", field="registration_id", reason="RETIRED")
    assert await domain.ledger.fence(rid, RegState.RETIRED, retired) == 1  # the blocked one
    ids = [acked.operation_id, done.operation_id, blocked.operation_id]
    domain.clock.now += domain.settings.result_ttl_seconds / 2
    await domain.ledger.sweep()
    # the acknowledged one is released after its grace and compacted; the others not yet
    assert await count_existing(domain, [keys.op(i) for i in ids]) == 2
    domain.clock.now += domain.settings.result_ttl_seconds
    await domain.ledger.sweep()
    assert await count_existing(domain, [keys.op(i) for i in ids]) == 0
    group = keys.group(keys.group_of(rid))
    assert await domain.client.zcard(group.retired) == 0
    assert await domain.client.zscore(group.results, done.operation_id) is None
    assert (await domain.ledger.get("t1", done.operation_id)).state == OpState.EXPIRED
    with pytest.raises(errors.FailedPrecondition):  # a late retry is refused, not re-admitted
        await submit(domain, rid, 2, b"b")
    # the live registration's released record went too: its head keeps the seq_id spent
    assert not await domain.client.exists(keys.op(kept.operation_id))
    assert (await domain.ledger.get("t1", kept.operation_id)).state == OpState.EXPIRED
    with pytest.raises(errors.Expired):
        await submit(domain, live, 1, b"k")
    assert (await domain.ledger.fleet_load())["unacked"] == 0
    depth = await domain.ledger.depth()
    assert not any(depth.get(s, 0) for s in ("expired", "failed", "succeeded"))


async def count_existing(d: Domain, keys: list[str]) -> int:
    return sum([int(await d.client.exists(key)) for key in keys])


async def connections_made(d: Domain) -> int:
    if d.settings.redis_cluster:  # counted on one server only (see the assertion)
        return 0
    return int((await d.client.info("stats"))["total_connections_received"])


@pytest.mark.parametrize("pipelined", [True, False])
async def test_concurrent_submits_share_one_round_trip(domain: Domain, pipelined: bool) -> None:
    """Submits made together each get their own answer (admitted, duplicate, refused), in
    one pipeline on one connection when `pipeline_submits` is on."""
    # limits whose first leases (store/quota.py) cover every call: no lease round trip
    d = await domain.restart(
        pipeline_submits=pipelined, max_pending_global=4096, max_pending_per_tenant=4096
    )
    rid = await d.ready_registration()
    await submit(d, rid, 1, b"first")
    # an empty pool: connections are counted
    fresh = connect(d.settings.redis_url, cluster=d.settings.redis_cluster)
    try:
        store = Store(fresh, d.settings.key_prefix, d.settings.ledger_groups)
        store.epoch = d.store.epoch
        ledger = L.Ledger(store, d.settings, d.notifier, d.clock)
        before = await connections_made(d)
        calls = [ledger.submit("t1", rid, seq, FB, b"x", f"d{seq}") for seq in range(2, 8)]
        calls += [
            ledger.submit("t1", rid, 1, FB, b"first", "d:b'first'"),  # a retry
            ledger.submit("t1", rid, 1, FB, b"other", "other"),  # a conflict
            ledger.submit("t1", "no-such-registration", 1, FB, b"x", "d"),
        ]
        out = await asyncio.gather(*calls, return_exceptions=True)
        made = await connections_made(d) - before
    finally:
        await fresh.aclose()
    admitted = [a for a in out[:7] if isinstance(a, L.Admission)]
    assert [a.operation_id for a in admitted] == [
        *(L.operation_id(rid, s) for s in range(2, 8)),
        L.operation_id(rid, 1),
    ]
    # The Cluster client may re-send a call whose answer it lost: idempotency makes it a
    # duplicate there, so first-time admissions are only checked on one server.
    if not d.settings.redis_cluster:
        assert [a.duplicate for a in admitted] == [False] * 6 + [True]
    assert isinstance(out[7], errors.Conflict) and out[7].field == "seq_id"
    assert isinstance(out[8], errors.NotFound) and out[8].field == "registration_id"
    if not d.settings.redis_cluster:  # a Cluster pipeline cannot carry EVALSHA (store/coalesce.py)
        assert (made == 1) if pipelined else (made == len(calls)), made
    assert (await d.ledger.get("t1", L.operation_id(rid, 7))).state == OpState.QUEUED


async def test_pipelined_submits_survive_a_flushed_script_cache(domain: Domain) -> None:
    """A restarted Redis has no scripts: the pipeline's NOSCRIPT answers are re-run."""
    rid = await domain.ready_registration()
    await domain.client.script_flush()
    out = await asyncio.gather(*(submit(domain, rid, seq, b"x%d" % seq) for seq in (1, 2, 3)))
    assert [a.operation_id for a in out] == [L.operation_id(rid, s) for s in (1, 2, 3)]
    assert [a.duplicate for a in out] == [False] * 3


async def test_only_the_newest_claim_records_an_outcome(domain: Domain) -> None:
    """An operation whose trainer was lost is queued again and claimed again; the answer to
    its first claim (the old binding's, arriving late: a trainer frozen while its batch was
    in flight) must not be recorded, or the run's restored binding never applies it."""
    d = domain
    rid = await d.ready_registration()
    opid = (await submit(d, rid, 1)).operation_id
    first = await d.ledger.claim(opid)
    assert first is not None and first.claim == 1
    assert rid in await d.registry.replica_lost("tr-tiny", "trainer tr-tiny stopped answering")
    assert (await d.ledger.get("t1", opid)).state == OpState.QUEUED
    await d.registry.register_replica(  # the trainer is back, a new incarnation
        Replica("trainer", "tr-tiny", "127.0.0.1:1", "tiny", 64, "inc-2", 0, True)
    )
    placement = await d.registry.place(rid)
    assert placement.code == "placed"
    assert await d.registry.bound(rid, placement.replica, placement.slot)
    second = await d.ledger.claim(opid)
    assert second is not None and second.claim == 2
    loaded = await d.ledger.load_claim(opid)
    assert loaded is not None and loaded.claim == 2

    late = L.Outcome(opid, OpState.SUCCEEDED, b"old binding", claim=first.claim)
    assert await d.ledger.complete_many([late]) == [False]
    op = await d.ledger.get("t1", opid)
    assert op.state == OpState.CLAIMED
    assert (await d.registry.get_any(rid)).head == 1  # type: ignore[union-attr]
    current = L.Outcome(opid, OpState.SUCCEEDED, b"new binding", claim=second.claim)
    assert await d.ledger.complete_many([current]) == [True]
    op = await d.ledger.get("t1", opid)
    assert op.state == OpState.SUCCEEDED and op.result == b"new binding"


async def test_a_long_run_keeps_no_record_per_released_step(domain: Domain) -> None:
    """Issue 36 item 4: acknowledged and released operations leave no stub each (an RL run
    of a million steps, a sampler of millions of requests). What exactly-once needs stays:
    a retry of any released seq_id is refused, never run again; the one released out of
    order (past the head) keeps its stub until the head passes it."""
    from lorafleet_controller.store.quota import Limits
    from lorafleet_controller.store.samplers import SamplersRepo

    keys = domain.store.keys
    rid = await domain.ready_registration()
    steps = 120
    for seq in range(1, steps + 1):
        adm = await submit(domain, rid, seq, b"s%d" % seq)
        await run_one(domain, (await pop_ready(domain))[-1])
        await domain.ledger.ack("t1", adm.operation_id)
    samples = SamplersRepo(domain.store)
    limits = Limits(10_000, 10_000, 10_000, 10_000, 1 << 20, 1 << 20, 1 << 20, 1 << 20)
    for n in range(40):
        opid = f"sess:sampler:0#s{n}"
        out = await samples.submit(opid, "t1", f"d{n}", b"body", domain.clock.now, rid, limits)
        assert out.code == "created"
        assert await domain.ledger.claim(opid, fenced=False) is not None
        assert await domain.ledger.complete(opid, OpState.SUCCEEDED, b"r", fenced=False)
        await domain.ledger.ack("t1", opid)
    domain.clock.now += domain.settings.acked_result_grace_seconds + 1
    while (await domain.ledger.sweep()).results_expired:
        pass
    left = [k async for k in domain.client.scan_iter(match="*op:*")]
    assert left == [], left[:5]
    for seq in (1, steps // 2, steps):
        rec = await domain.ledger.get("t1", L.operation_id(rid, seq))
        assert rec.state == OpState.EXPIRED and rec.result == b""
        with pytest.raises(errors.Expired):
            await submit(domain, rid, seq, b"s%d" % seq)
    with pytest.raises(errors.NotFound):  # another tenant learns nothing
        await domain.ledger.get("t2", L.operation_id(rid, 1))
    with pytest.raises(errors.NotFound):  # never submitted: not a released one
        await domain.ledger.get("t1", L.operation_id(rid, steps + 1))
    depth = await domain.ledger.depth()
    assert not any(depth.get(s, 0) for s in ("expired", "succeeded", "queued"))
    # Out of order: seq steps+2 finishes (born failed) and is released while steps+1 still
    # waits; its stub stays until the head passes it, then goes.
    head = await submit(domain, rid, steps + 1, b"head")
    rejected = errors.InvalidArgument("bad", field="x")
    late = await submit(domain, rid, steps + 2, b"late", rejection=rejected)
    await domain.ledger.ack("t1", late.operation_id)
    domain.clock.now += domain.settings.acked_result_grace_seconds + 1
    await domain.ledger.sweep()
    assert (await domain.ledger.get("t1", late.operation_id)).state == OpState.EXPIRED
    assert await domain.client.exists(keys.op(late.operation_id))
    assert (await submit(domain, rid, steps + 2, b"late")).duplicate
    await run_one(domain, head.operation_id)
    assert not await domain.client.exists(keys.op(late.operation_id))
    assert (await domain.ledger.get("t1", late.operation_id)).state == OpState.EXPIRED
    assert (await domain.ledger.depth()).get("expired", 0) == 0
