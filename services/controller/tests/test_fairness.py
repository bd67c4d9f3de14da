"""Per-tenant limits: one tenant's flood of never-retrieved results refuses that tenant only."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet import errors
from lorafleet_controller.scheduler import BATCH_PER_TENANT, fair_batch
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import OpState, RegState

from .conftest import Domain

FORWARD = 1


async def run_head(d: Domain, rid: str, seq: int) -> None:
    """Dispatch and finish one operation, as the scheduler would (no trainer involved)."""
    (claim,) = await d.ledger.claim_many([], 1)
    assert claim.operation_id == f"{rid}#{seq}"
    assert await d.ledger.complete(claim.operation_id, OpState.SUCCEEDED, b"out")


async def test_a_flood_of_unretrieved_results_refuses_only_its_tenant(domain: Domain) -> None:
    d = await domain.restart(
        max_unacked_results_per_tenant=6, max_unacked_results=100, max_pending_per_tenant=6,
    )  # fmt: skip
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
    backlog = await d.ledger.claim_many([], 64)
    assert [c.registration_id for c in backlog] == b_runs  # claimed in arrival order
    first = fair_batch(backlog, BATCH_PER_TENANT)
    assert [c.registration_id for c in first] == b_runs[:BATCH_PER_TENANT]
    assert [c.registration_id for c in backlog] == b_runs[BATCH_PER_TENANT:]
    # A's step arrives behind B's whole backlog and still runs in the next batch.
    await d.ledger.submit("a", a_run, 1, FORWARD, b"s", "s1")
    backlog += await d.ledger.claim_many([], 64)
    second = fair_batch(backlog, BATCH_PER_TENANT)
    assert [c.tenant for c in second][:2] == ["b", "a"]  # interleaved tenant by tenant
    assert [c.registration_id for c in second if c.tenant == "b"] == b_runs[
        BATCH_PER_TENANT : 2 * BATCH_PER_TENANT
    ]  # B keeps its arrival order, and its cap
    assert a_run in {c.registration_id for c in second}
    assert backlog and all(c.tenant == "b" for c in backlog)  # B's backlog is not drained yet
    drained = fair_batch(backlog, BATCH_PER_TENANT)
    assert [c.registration_id for c in drained] == b_runs[2 * BATCH_PER_TENANT :]
    assert backlog == []
    await d.notifier.stop()


def test_limits_are_settings() -> None:
    names = {f.name for f in dataclasses.fields(ControllerSettings)}
    assert {"max_pending_per_tenant", "max_unacked_results_per_tenant",
            "max_registrations_per_tenant"} <= names  # fmt: skip
