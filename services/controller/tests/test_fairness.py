"""Per-tenant limits: one tenant's flood of never-retrieved results refuses that tenant only."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from lorafleet import errors
from lorafleet.settings import SettingsError, load_settings
from lorafleet_controller.ledger import Claim, Outcome
from lorafleet_controller.scheduler import (
    BATCH_PER_TENANT,
    BATCH_SHARE_CONTENDED,
    LIGHT_RECENT_S,
    FairBatcher,
    fair_batch,
)
from lorafleet_controller.settings import PREFIX, ControllerSettings
from lorafleet_controller.store import OpState, RegState

from .conftest import Domain

FORWARD = 1


async def run_head(d: Domain, rid: str, seq: int) -> None:
    """Dispatch and finish one operation, as the scheduler would (no trainer involved)."""
    (claim,) = await d.claim_ready(1)
    assert claim.operation_id == f"{rid}#{seq}"
    assert await d.ledger.complete(claim.operation_id, OpState.SUCCEEDED, b"out")


async def test_a_flood_of_unretrieved_results_refuses_only_its_tenant(domain: Domain) -> None:
    d = await domain.restart(
        max_unacked_results_per_tenant=6,
        max_unacked_results=100,
        max_pending_per_tenant=6,
    )
    flooder = await d.ready_registration(tenant="b", session="sb")
    for seq in range(1, 7):  # B's forward results are never retrieved
        await d.ledger.submit("b", flooder, seq, FORWARD, b"f", f"f{seq}")
        await run_head(d, flooder, seq)
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", flooder, 7, FORWARD, b"f", "f7")
    assert "this tenant" in refused.value.message and refused.value.reason == "BACKPRESSURE"
    assert (await d.ledger.tenant_load("b"))["unacked"] == 6
    # Tenant A is untouched: it submits, runs and retrieves as usual.
    worker = await d.ready_registration(tenant="a", session="sa")
    for seq in range(1, 11):
        adm = await d.ledger.submit("a", worker, seq, FORWARD, b"x", f"x{seq}")
        assert adm.state == OpState.QUEUED
        await run_head(d, worker, seq)
        await d.ledger.ack("a", adm.operation_id)
    # B may go on as soon as it retrieves a result.
    await d.ledger.ack("b", f"{flooder}#1")
    assert not (await d.ledger.submit("b", flooder, 7, FORWARD, b"f", "f7")).duplicate
    await d.notifier.stop()


async def test_open_operations_and_registrations_are_limited_per_tenant(domain: Domain) -> None:
    d = await domain.restart(max_pending_per_tenant=3, max_registrations_per_tenant=2)
    first = await d.ready_registration(tenant="b", session="s1")
    await d.ready_registration(tenant="b", session="s2")
    with pytest.raises(errors.ResourceExhausted) as exc:
        await d.ready_registration(tenant="b", session="s3")
    assert exc.value.reason == "REGISTRATION_LIMIT"
    for seq in (1, 2, 3):
        await d.ledger.submit("b", first, seq, FORWARD, b"p", f"p{seq}")
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("b", first, 4, FORWARD, b"p", "p4")
    other = await d.ready_registration(tenant="a", session="sa")
    assert (await d.ledger.submit("a", other, 1, FORWARD, b"p", "p1")).state == OpState.QUEUED
    # A retired registration no longer counts against its tenant.
    retired = errors.FailedPrecondition("gone", reason="RETIRED")
    await d.ledger.fence(first, RegState.RETIRED, retired)
    await d.registry.release(first)
    assert (await d.ledger.tenant_load("b"))["registrations"] == 1
    assert (await d.ledger.tenant_load("b"))["pending"] == 0
    await d.ready_registration(tenant="b", session="s3")
    await d.notifier.stop()


async def test_a_tenants_step_is_batched_before_another_tenants_backlog_drains(
    domain: Domain,
) -> None:
    """Batch formation is fair: B's backlog (one ready head on each of many runs) is split
    over batches of at most BATCH_PER_TENANT of B's operations, and A's operation, submitted
    after B's whole backlog was claimed, joins the very next batch (an ordering property:
    nothing here depends on timing)."""
    d = domain
    b_runs = [await d.ready_registration(tenant="b", session="sb", seq=i) for i in range(20)]
    a_run = await d.ready_registration(tenant="a", session="sa")
    for rid in b_runs:
        await d.ledger.submit("b", rid, 1, FORWARD, b"f", f"f-{rid}")
    backlog = await d.claim_ready(64)
    # claimed group by group (store/keys.py), each group's in arrival order
    b_runs.sort(key=d.store.keys.group_of)
    assert [c.registration_id for c in backlog] == b_runs
    first = fair_batch(backlog, lambda _: BATCH_PER_TENANT)
    assert [c.registration_id for c in first] == b_runs[:BATCH_PER_TENANT]
    assert [c.registration_id for c in backlog] == b_runs[BATCH_PER_TENANT:]
    # A's step arrives behind B's whole backlog and still runs in the next batch.
    await d.ledger.submit("a", a_run, 1, FORWARD, b"s", "s1")
    backlog += await d.claim_ready(64)
    second = fair_batch(backlog, lambda _: BATCH_PER_TENANT)
    assert [c.tenant for c in second][:2] == ["b", "a"]  # interleaved tenant by tenant
    assert [c.registration_id for c in second if c.tenant == "b"] == b_runs[
        BATCH_PER_TENANT : 2 * BATCH_PER_TENANT
    ]  # B keeps its arrival order, and its cap
    assert a_run in {c.registration_id for c in second}
    assert backlog and all(c.tenant == "b" for c in backlog)  # B's backlog is not drained yet
    drained = fair_batch(backlog, lambda _: BATCH_PER_TENANT)
    assert [c.registration_id for c in drained] == b_runs[2 * BATCH_PER_TENANT :]
    assert backlog == []
    await d.notifier.stop()


async def test_a_batch_limit_takes_the_fair_order_and_keeps_the_rest_in_order(
    domain: Domain,
) -> None:
    """max_batch_operations: the batch is the fair order cut at the limit (1: every
    operation alone, so no run's pass depends on its co-tenants); the rest stay in arrival
    order for the next batches, and nothing is dropped."""
    d = domain
    for tenant in "ab":
        for i in (0, 1):
            rid = await d.ready_registration(tenant=tenant, session=f"s{tenant}{i}")
            await d.ledger.submit(tenant, rid, 1, FORWARD, b"f", f"f-{rid}")
    backlog = await d.claim_ready(64)
    order = [c.operation_id for c in backlog]
    assert len(order) == 4
    two = fair_batch(list(backlog), lambda _: BATCH_PER_TENANT, 2)
    assert [c.tenant for c in two] == ["a", "b"]  # the fair order, cut
    taken = []
    while backlog:
        batch = fair_batch(backlog, lambda _: BATCH_PER_TENANT, 1)
        assert len(batch) == 1
        taken.append(batch[0].operation_id)
    assert taken == order  # one at a time, each the oldest left
    await d.notifier.stop()


async def run_batch(d: Domain, batcher: FairBatcher) -> list[Claim]:
    """Take the next batch and record every operation in it, as the data worker does."""
    batch = batcher.take()
    done = await d.ledger.complete_many(
        [Outcome(c.operation_id, OpState.SUCCEEDED, b"out") for c in batch]
    )
    assert all(done)
    batcher.finished()
    return batch


def flood_ops(batch: list[Claim]) -> list[str]:
    return [c.registration_id for c in batch if c.tenant == "b"]


async def test_a_light_tenants_step_joins_and_waits_behind_only_a_small_share_of_a_flood(
    domain: Domain,
) -> None:
    """A light tenant (one run stepping in lockstep) pays for a flood's batch twice: the one
    its step joins and the one already on the trainer when its step arrives. While it is
    about, both hold BATCH_SHARE_CONTENDED of the flood's operations, not BATCH_PER_TENANT;
    with no light tenant about, the flood is batched BATCH_PER_TENANT at a time again. Every
    operation is batched exactly once, each tenant's in arrival order. Ordering and counts
    only: the batcher reads the domain's settable clock."""
    assert 0 < BATCH_SHARE_CONTENDED < BATCH_PER_TENANT
    d = domain
    b_runs = [await d.ready_registration(tenant="b", session="sb", seq=i) for i in range(24)]
    a_run = await d.ready_registration(tenant="a", session="sa")
    for rid in b_runs:
        await d.ledger.submit("b", rid, 1, FORWARD, b"f", f"f-{rid}")
    batcher = FairBatcher(clock=d.clock)
    batcher.backlog += await d.claim_ready(64)
    b_runs.sort(key=d.store.keys.group_of)  # claimed group by group, each in arrival order
    # No one else about: the flood takes its whole share.
    batches = [await run_batch(d, batcher)]
    assert flood_ops(batches[-1]) == b_runs[:BATCH_PER_TENANT]
    for seq in (1, 2):
        # A's step arrives behind the rest of the flood and joins the very next batch, with
        # only a small share of the flood beside it.
        await d.ledger.submit("a", a_run, seq, FORWARD, b"s", f"s{seq}")
        batcher.backlog += await d.claim_ready(64)
        batches.append(await run_batch(d, batcher))
        assert a_run in {c.registration_id for c in batches[-1]}
        assert len(flood_ops(batches[-1])) == BATCH_SHARE_CONTENDED
        await d.ledger.ack("a", f"{a_run}#{seq}")
        # Its next step is on its way: the batch it will find on the trainer is small too.
        batches.append(await run_batch(d, batcher))
        assert len(flood_ops(batches[-1])) == BATCH_SHARE_CONTENDED
    # A has been gone for longer than LIGHT_RECENT_S: the flood's full share again.
    d.clock.now += 2 * LIGHT_RECENT_S
    batches.append(await run_batch(d, batcher))
    assert len(flood_ops(batches[-1])) == BATCH_PER_TENANT
    while batcher.backlog:
        batches.append(await run_batch(d, batcher))
    assert [rid for batch in batches for rid in flood_ops(batch)] == b_runs
    assert [c.seq_id for batch in batches for c in batch if c.tenant == "a"] == [1, 2]
    assert await d.claim_ready(64) == []  # nothing left behind
    await d.notifier.stop()


async def test_busy_tenants_alone_keep_their_whole_share(domain: Domain) -> None:
    """The smaller share is for a light tenant's sake only: busy tenants (each with more than
    BATCH_SHARE_CONTENDED waiting) share batches of BATCH_PER_TENANT each, and a tenant that
    was light itself is not held back by its own past."""
    d = domain
    b_runs = [await d.ready_registration(tenant="b", session="sb", seq=i) for i in range(12)]
    c_runs = [await d.ready_registration(tenant="c", session="sc", seq=i) for i in range(12)]
    batcher = FairBatcher(clock=d.clock)
    await d.ledger.submit("b", b_runs[0], 1, FORWARD, b"f", "f1")
    batcher.backlog += await d.claim_ready(64)
    assert flood_ops(await run_batch(d, batcher)) == b_runs[:1]  # B alone and light
    for rid in b_runs[1:]:
        await d.ledger.submit("b", rid, 1, FORWARD, b"f", f"f-{rid}")
    batcher.backlog += await d.claim_ready(64)
    b_runs[1:] = sorted(b_runs[1:], key=d.store.keys.group_of)  # claimed group by group
    assert flood_ops(await run_batch(d, batcher)) == b_runs[1 : 1 + BATCH_PER_TENANT]
    for rid in c_runs:
        await d.ledger.submit("c", rid, 1, FORWARD, b"f", f"f-{rid}")
    batcher.backlog += await d.claim_ready(64)
    c_runs.sort(key=d.store.keys.group_of)
    both = await run_batch(d, batcher)
    assert [c.tenant for c in both] == ["b", "c"] * 3 + ["c"] * (BATCH_PER_TENANT - 3)
    assert [c.registration_id for c in both if c.tenant == "c"] == c_runs[:BATCH_PER_TENANT]
    await d.notifier.stop()


def test_limits_are_settings() -> None:
    names = {f.name for f in dataclasses.fields(ControllerSettings)}
    assert {
        "max_pending_per_tenant",
        "max_unacked_results_per_tenant",
        "max_registrations_per_tenant",
    } <= names


def spread(rid: str) -> float:
    """submit.lua's offset of a registration, as a fraction of its RETRY_SPREAD (a tenth)
    of the half-bucket window, in [0, 1)."""
    return int(hashlib.sha1(rid.encode()).hexdigest()[:8], 16) / 2**32


async def test_admission_bucket_refills_bursts_isolates_tenants_and_refusals_leave_no_trace(
    domain: Domain,
) -> None:
    """The per-tenant token bucket of submit.lua on real Redis, with the domain's settable
    clock: `burst` admissions at once, then one per 1/rate seconds; another tenant's bucket
    is its own; a refusal is backpressure that writes nothing, so its retry is a first
    admission and seq_id order holds."""
    d = await domain.restart(
        admission_rate_per_tenant=2.0,
        admission_burst_per_tenant=3,
        max_pending_per_registration=64,
    )
    b = await d.ready_registration(tenant="b", session="sb")
    a = await d.ready_registration(tenant="a", session="sa")
    for seq in (1, 2, 3):  # the burst
        adm = await d.ledger.submit("b", b, seq, FORWARD, b"f", f"f{seq}")
        assert adm.state == OpState.QUEUED

    async def trace() -> tuple[object, ...]:
        r, k = d.client, d.store.keys
        return (
            await r.hgetall(k.reg(b)),
            await r.hmget(k.tenant("b"), "bucket_tokens", "bucket_at"),
            await d.ledger.tenant_load("b"),  # what it uses (its leases may move)
            await d.ledger.fleet_load(),
            await r.exists(k.op(f"{b}#4")),
            await r.llen(k.group(k.group_of(b)).ready_ctl),
            await r.llen(k.group(k.group_of(b)).ready_data),
            await r.hgetall(k.group(k.group_of(b)).depth),
        )

    before = await trace()
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b, 4, FORWARD, b"f", "f4")
    assert refused.value.reason == "BACKPRESSURE" and refused.value.field == "seq_id"
    assert "admissions per second" in refused.value.message
    # Retry when the bucket is half full again (1.5 tokens at 2/s), plus this registration's
    # own offset into a tenth of the next half-bucket window.
    assert refused.value.retry_after == pytest.approx(0.75 + 0.075 * spread(b))
    assert await trace() == before  # nothing written: not the op, the bucket or a counter
    # Another of B's runs refused at the same moment is told another time: no herd.
    b2 = await d.ready_registration(tenant="b", session="sb", seq=1)
    with pytest.raises(errors.ResourceExhausted) as other:
        await d.ledger.submit("b", b2, 1, FORWARD, b"f", "g1")
    assert other.value.retry_after == pytest.approx(0.75 + 0.075 * spread(b2))
    assert other.value.retry_after != refused.value.retry_after  # (hashes of two ids)
    # A duplicate of an admitted seq_id is answered, not charged or refused.
    assert (await d.ledger.submit("b", b, 3, FORWARD, b"f", "f3")).duplicate
    # Tenant A's bucket is its own: its whole burst is there while B's is empty.
    for seq in (1, 2, 3):
        adm = await d.ledger.submit("a", a, seq, FORWARD, b"x", f"x{seq}")
        assert adm.state == OpState.QUEUED
    # Refill: half a token after 0.25 s (still refused, half full in 0.5 s), one at 0.5 s.
    d.clock.now += 0.25
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b, 4, FORWARD, b"f", "f4")
    assert refused.value.retry_after == pytest.approx(0.5 + 0.075 * spread(b))
    d.clock.now += 0.25
    retried = await d.ledger.submit("b", b, 4, FORWARD, b"f", "f4")
    assert not retried.duplicate and retried.state == OpState.QUEUED  # a first admission
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("b", b, 5, FORWARD, b"f", "f5")
    # A long idle refills to `burst`, no more.
    d.clock.now += 1000
    for seq in (5, 6, 7):
        await d.ledger.submit("b", b, seq, FORWARD, b"f", f"f{seq}")
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("b", b, 8, FORWARD, b"f", "f8")
    # A hole-filling seq_id is never refused (a gap must not wait on the bucket) but pays:
    # 9 skips 8, 8 fills the hole with the bucket empty (-1), and 10 is told 2.5 tokens' wait.
    d.clock.now += 0.5
    await d.ledger.submit("b", b, 9, FORWARD, b"f", "f9")
    await d.ledger.submit("b", b, 8, FORWARD, b"f", "f8")
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b, 10, FORWARD, b"f", "f10")
    assert refused.value.retry_after == pytest.approx(1.25 + 0.075 * spread(b))
    # Ordering by seq_id is unchanged: B's operations run 1..9, one head at a time.
    ran: list[int] = []
    for _ in range(20):
        for claim in await d.claim_ready(64):
            ran += [claim.seq_id] if claim.registration_id == b else []
            await d.ledger.complete(claim.operation_id, OpState.SUCCEEDED, b"out")
    assert ran == list(range(1, 10))
    await d.notifier.stop()


async def test_admission_rate_zero_means_no_bucket(domain: Domain) -> None:
    d = await domain.restart(
        admission_rate_per_tenant=0.0, admission_burst_per_tenant=1, max_pending_per_registration=64
    )
    b = await d.ready_registration(tenant="b", session="sb")
    for seq in range(1, 11):
        await d.ledger.submit("b", b, seq, FORWARD, b"f", f"f{seq}")
    assert not await d.client.hexists(d.store.keys.tenant("b"), "bucket_tokens")
    await d.notifier.stop()


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("ADMISSION_RATE_PER_TENANT", "-1"),
        ("ADMISSION_RATE_PER_TENANT", "fast"),
        ("ADMISSION_BURST_PER_TENANT", "0"),
    ],
)
def test_admission_bucket_settings_are_validated_naming_the_variable(var: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=PREFIX + var):
        load_settings(ControllerSettings, PREFIX, {PREFIX + var: raw})
