"""Admission counts bytes (issue 36 item 3), on one redis-server in 8 groups and on the
Cluster: a tenant's open payloads and unacknowledged results are bounded in bytes as in
records, refusals are backpressure that write nothing and refuse only that tenant, and every
byte counted at admission or completion goes back exactly once (acknowledged, expired, swept,
sealed, fenced)."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet_controller.ledger import admission_limits
from lorafleet_controller.store import OpState, RegState
from lorafleet_controller.store.samplers import SamplersRepo

from .conftest import Domain
from .test_quota import in_other_groups

FB = 2  # OPERATION_KIND_FORWARD_BACKWARD
KIB = 1024
ZERO = {"pending": 0, "unacked": 0, "pending_bytes": 0, "unacked_bytes": 0}


async def run(d: Domain, tenant: str, rid: str, seq: int, result: bytes) -> str:
    """Dispatch and finish the head operation `rid#seq`, as the scheduler would."""
    opid = f"{rid}#{seq}"
    claim = await d.ledger.claim(opid)
    assert claim is not None and claim.tenant == tenant, opid
    assert await d.ledger.complete(opid, OpState.SUCCEEDED, result)
    return opid


def load(counts: dict[str, int]) -> dict[str, int]:
    return {k: counts[k] for k in ZERO}


async def test_open_payload_bytes_refuse_only_their_tenant_until_they_finish(
    domain: Domain,
) -> None:
    d = await domain.restart(max_pending_bytes_per_tenant=4 * KIB, max_registrations_per_tenant=64)
    # B's 4 KiB over two groups: its limit exactly, so a lease moves between the groups.
    b1, b2 = await in_other_groups(d, "b", 2)
    for rid, seq in ((b1, 1), (b1, 2), (b2, 1), (b2, 2)):
        await d.ledger.submit("b", rid, seq, FB, b"x" * KIB, f"{rid}{seq}")
    assert load(await d.ledger.tenant_load("b")) == {**ZERO, "pending": 4, "pending_bytes": 4 * KIB}

    async def trace() -> tuple[object, ...]:
        return (
            await d.ledger.tenant_load("b"),
            await d.ledger.fleet_load(),
            await d.client.exists(d.store.keys.op(f"{b1}#3")),
            await d.client.hgetall(d.store.keys.reg(b1)),
        )

    before = await trace()
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b1, 3, FB, b"y", "b13")  # one byte more
    assert refused.value.reason == "BACKPRESSURE" and refused.value.field == "seq_id"
    assert "MAX_PENDING_BYTES_PER_TENANT" in refused.value.message
    assert "payload bytes in this tenant's open operations" in refused.value.message
    assert await trace() == before  # nothing written
    # Another tenant is admitted meanwhile, a payload as large as B's whole use.
    a = await d.ready_registration(tenant="a", session="sa")
    assert (await d.ledger.submit("a", a, 1, FB, b"z" * 4 * KIB, "a1")).state == OpState.QUEUED
    # B's operations finish: their payload bytes go, their results' bytes come; acknowledged,
    # those go too, and B is admitted again (the leases its other group holds come back).
    for rid in (b1, b2):
        for seq in (1, 2):
            opid = await run(d, "b", rid, seq, b"r" * 100)
            assert (await d.ledger.tenant_load("b"))["pending_bytes"] < 4 * KIB
            await d.ledger.ack("b", opid)
            await d.ledger.ack("b", opid)  # twice: released once
    assert load(await d.ledger.tenant_load("b")) == ZERO
    for seq in (3, 4, 5, 6):
        await d.ledger.submit("b", b1, seq, FB, b"x" * KIB, f"b1{seq}")
    assert (await d.ledger.tenant_load("b"))["pending_bytes"] == 4 * KIB
    # The fleet's counts are the tenants' sum, and the acknowledged results leave nothing
    # behind when the sweep releases them.
    fleet = await d.ledger.fleet_load()
    assert fleet["pending_bytes"] == 8 * KIB and fleet["unacked_bytes"] == 0
    d.clock.now += d.settings.acked_result_grace_seconds + 1
    assert (await d.ledger.sweep()).results_expired == 4
    assert (await d.ledger.tenant_load("b"))["unacked_bytes"] == 0
    await d.notifier.stop()


async def test_the_fleets_open_payload_bytes_are_bounded_over_tenants(domain: Domain) -> None:
    d = await domain.restart(max_pending_bytes_global=4 * KIB)
    a = await d.ready_registration(tenant="a", session="sa")
    b = await d.ready_registration(tenant="b", session="sb")
    await d.ledger.submit("a", a, 1, FB, b"x" * 3 * KIB, "a1")
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b, 1, FB, b"x" * 2 * KIB, "b1")
    assert "MAX_PENDING_BYTES_GLOBAL" in refused.value.message
    assert (await d.ledger.submit("b", b, 1, FB, b"x" * KIB, "b1s")).state == OpState.QUEUED
    await d.notifier.stop()


async def test_unacknowledged_result_bytes_refuse_only_their_tenant_until_released(
    domain: Domain,
) -> None:
    d = await domain.restart(max_unacked_bytes_per_tenant=2 * KIB)
    b = await d.ready_registration(tenant="b", session="sb")
    for seq in (1, 2):  # B never retrieves its results: 2 KiB of them
        await d.ledger.submit("b", b, seq, FB, b"f", f"f{seq}")
        await run(d, "b", b, seq, b"r" * KIB)
    assert load(await d.ledger.tenant_load("b")) == {**ZERO, "unacked": 2, "unacked_bytes": 2 * KIB}
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("b", b, 3, FB, b"f", "f3")
    assert refused.value.reason == "BACKPRESSURE"
    assert "MAX_UNACKED_BYTES_PER_TENANT" in refused.value.message
    assert not await d.client.exists(d.store.keys.op(f"{b}#3"))
    # Tenant A is untouched: it submits, runs and retrieves results of that size as usual.
    a = await d.ready_registration(tenant="a", session="sa")
    for seq in range(1, 6):
        await d.ledger.submit("a", a, seq, FB, b"x", f"x{seq}")
        await d.ledger.ack("a", await run(d, "a", a, seq, b"r" * KIB))
    assert load(await d.ledger.tenant_load("a")) == ZERO
    # B may go on once one result is acknowledged: its bytes went back exactly.
    await d.ledger.ack("b", f"{b}#1")
    assert (await d.ledger.tenant_load("b"))["unacked_bytes"] == KIB
    assert not (await d.ledger.submit("b", b, 3, FB, b"f", "f3")).duplicate
    # The unacknowledged one expires after the result TTL (the sweep, with the acknowledged
    # ones), the queued one fails when the run is fenced: its error's bytes count until it
    # is acknowledged, and none stays.
    d.clock.now += d.settings.result_ttl_seconds + 1
    assert (await d.ledger.sweep()).results_expired == 7  # A's 5 and B's 2
    assert (await d.ledger.tenant_load("b"))["unacked_bytes"] == 0
    retired = errors.FailedPrecondition("gone", reason="RETIRED")
    assert await d.ledger.fence(b, RegState.RETIRED, retired) == 1
    failed = await d.ledger.get("b", f"{b}#3")
    assert failed.state == OpState.FAILED
    assert (await d.ledger.tenant_load("b"))["unacked_bytes"] > 0
    await d.ledger.ack("b", f"{b}#3")
    assert load(await d.ledger.tenant_load("b")) == ZERO
    assert load(await d.ledger.fleet_load()) == ZERO
    await d.notifier.stop()


async def test_sealed_gaps_and_rejected_payloads_count_their_errors_bytes(
    domain: Domain,
) -> None:
    rid = await domain.ready_registration()
    rejected = errors.InvalidArgument("lr is nan", field="adam_params.learning_rate")
    await domain.ledger.submit("t1", rid, 1, 3, b"bad", "bad", rejection=rejected)
    await domain.ledger.submit("t1", rid, 3, FB, b"three", "three")  # 2 never comes
    domain.clock.now += domain.settings.gap_timeout_seconds + 1
    assert (await domain.ledger.sweep()).gaps_sealed == 1
    counted = await domain.ledger.tenant_load("t1")
    assert counted["unacked"] == 3 and counted["pending_bytes"] == 0
    errors_bytes = 0
    for seq in (1, 2, 3):
        rec = await domain.ledger.get("t1", f"{rid}#{seq}")
        assert rec.state == OpState.FAILED and rec.error is not None
        stored = await domain.client.hget(domain.store.keys.op(rec.operation_id), "error")
        errors_bytes += len(stored or b"")
    assert counted["unacked_bytes"] == errors_bytes
    for seq in (1, 2, 3):
        await domain.ledger.ack("t1", f"{rid}#{seq}")
    assert load(await domain.ledger.tenant_load("t1")) == ZERO


async def test_samples_count_their_payload_and_result_bytes(domain: Domain) -> None:
    rid = await domain.ready_registration()
    samples = SamplersRepo(domain.store)
    limits = admission_limits(domain.settings, bucket=False)
    opid = "sess:sampler:0#s0"
    created = await samples.submit(opid, "t1", "d", b"b" * 300, domain.clock.now, rid, limits)
    assert created.code == "created"
    assert (await domain.ledger.tenant_load("t1"))["pending_bytes"] == 300
    assert await domain.ledger.claim(opid, fenced=False) is not None
    assert await domain.ledger.complete(opid, OpState.SUCCEEDED, b"r" * 70, fenced=False)
    counted = await domain.ledger.tenant_load("t1")
    assert counted["pending_bytes"] == 0 and counted["unacked_bytes"] == 70
    await domain.ledger.ack("t1", opid)
    assert load(await domain.ledger.tenant_load("t1")) == ZERO


async def test_an_operation_larger_than_any_limit_is_invalid_not_backpressure(
    domain: Domain,
) -> None:
    d = await domain.restart(max_pending_bytes_per_tenant=2 * KIB)
    rid = await d.ready_registration()
    with pytest.raises(errors.InvalidArgument) as invalid:
        await d.ledger.submit("t1", rid, 1, FB, b"x" * (2 * KIB + 1), "big")
    assert invalid.value.field == "payload" and invalid.value.reason == "PAYLOAD_TOO_LARGE"
    assert "MAX_PENDING_BYTES_PER_TENANT" in invalid.value.message
    assert load(await d.ledger.tenant_load("t1")) == ZERO  # nothing written, seq_id free
    assert (await d.ledger.submit("t1", rid, 1, FB, b"x" * 2 * KIB, "fits")).state == (
        OpState.QUEUED
    )
    d = await domain.restart(max_pending_bytes_global=KIB)
    with pytest.raises(errors.InvalidArgument) as invalid:
        await d.ledger.submit("t1", rid, 2, FB, b"x" * (KIB + 1), "big")
    assert "MAX_PENDING_BYTES_GLOBAL" in invalid.value.message
    await d.notifier.stop()


async def test_holes_are_held_to_the_byte_limits_except_at_the_head(domain: Domain) -> None:
    """Skipping ahead and filling behind admits no more bytes than submitting in order; only
    the head's hole is admitted over the limit, since what is open behind it waits on it."""
    d = await domain.restart(max_pending_bytes_per_tenant=4 * KIB)
    rid = await d.ready_registration()
    await d.ledger.submit("t1", rid, 5, FB, b"x" * 3 * KIB, "five")  # holes 1-4
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("t1", rid, 3, FB, b"x" * 2 * KIB, "three")
    assert "MAX_PENDING_BYTES_PER_TENANT" in refused.value.message
    assert not await d.client.exists(d.store.keys.op(f"{rid}#3"))
    await d.ledger.submit("t1", rid, 2, FB, b"x" * KIB, "two")  # fits: 4 KiB
    await d.ledger.submit("t1", rid, 1, FB, b"x" * 2 * KIB, "one")  # the head: over it
    assert (await d.ledger.tenant_load("t1"))["pending_bytes"] == 6 * KIB
    for seq in (1, 2):  # the run moves: 3 is the head now, and admitted
        await run(d, "t1", rid, seq, b"r")
    await d.ledger.submit("t1", rid, 3, FB, b"x" * 2 * KIB, "three")
    assert (await d.ledger.tenant_load("t1"))["pending_bytes"] == 5 * KIB
    await d.notifier.stop()


async def test_the_sweeps_gauges_show_the_fleets_load_against_its_limits(domain: Domain) -> None:
    """lorafleet_admission_load / lorafleet_admission_limit (the ledger dashboard's panel):
    what the fleet holds of each kind, and the MAX_*_GLOBAL setting it is refused at."""
    from prometheus_client import REGISTRY

    from lorafleet_controller.flows import gauges

    d = await domain.restart(max_pending_bytes_global=64 * KIB, max_unacked_results=1000)
    rid = await d.ready_registration(tenant="g", session="sg")
    await d.ledger.submit("g", rid, 1, FB, b"x" * 3 * KIB, "g1")
    await d.ledger.submit("g", rid, 2, FB, b"x" * KIB, "g2")
    await run(d, "g", rid, 1, b"r" * 500)
    await gauges.update(d.ledger, d.registry, d.settings)

    def gauge(name: str, kind: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"kind": kind})

    want = {"pending": 1, "pending_bytes": KIB, "unacked": 1, "unacked_bytes": 500}
    assert {k: gauge("lorafleet_admission_load", k) for k in want} == want
    assert gauge("lorafleet_admission_limit", "pending_bytes") == 64 * KIB
    assert gauge("lorafleet_admission_limit", "unacked") == 1000
