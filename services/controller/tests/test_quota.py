"""The tenant's and the fleet's limits leased to the groups (store/quota.py), on one
redis-server in 8 groups and on the Cluster in 1: the use summed over the groups never
passes a limit, and what one group leased and no longer uses goes to another at its limit."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet import errors
from lorafleet.v1 import controller_pb2
from lorafleet_controller.store import OpState, named, text

from .conftest import Domain

FORWARD = controller_pb2.OPERATION_KIND_FORWARD


async def in_other_groups(d: Domain, tenant: str, count: int) -> list[str]:
    """`count` READY registrations of `tenant`, each in a group of its own where there are
    enough groups."""
    rids: list[str] = []
    groups: set[int] = set()
    seq = 0
    while len(rids) < count:
        rid = await d.ready_registration(tenant=tenant, session=f"s{tenant}", seq=seq)
        seq += 1
        group = d.store.keys.group_of(rid)
        if group not in groups or len(groups) == d.store.keys.groups:
            groups.add(group)
            rids.append(rid)
    return rids


async def test_a_tenants_limit_holds_over_groups_and_unused_leases_move(domain: Domain) -> None:
    d = await domain.restart(max_pending_per_tenant=4, max_registrations_per_tenant=64)
    a, b = await in_other_groups(d, "t", 2)
    for seq in range(1, 5):
        await d.ledger.submit("t", a, seq, FORWARD, b"f", f"a{seq}")
    with pytest.raises(errors.ResourceExhausted) as refused:
        await d.ledger.submit("t", b, 1, FORWARD, b"f", "b1")
    assert refused.value.reason == "BACKPRESSURE" and "tenant" in refused.value.message
    assert (await d.ledger.tenant_load("t"))["pending"] == 4
    # Two of a's operations finish: their units go to b's group (taken back from a's).
    for seq in (1, 2):
        claim = await d.ledger.claim(f"{a}#{seq}")
        assert claim is not None
        await d.ledger.complete(claim.operation_id, OpState.SUCCEEDED, b"r")
    for seq in (1, 2):
        assert (await d.ledger.submit("t", b, seq, FORWARD, b"f", f"b{seq}")).state == (
            OpState.QUEUED
        )
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("t", b, 3, FORWARD, b"f", "b3")
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("t", a, 5, FORWARD, b"f", "a5")
    assert (await d.ledger.tenant_load("t"))["pending"] == 4
    assert (await d.ledger.fleet_load())["pending"] == 4
    await d.notifier.stop()


async def test_a_lease_set_late_after_a_take_back_changes_nothing(domain: Domain) -> None:
    """A lease granted and then taken back before its set reached the group: the late set
    is refused by version, so the group never holds what the coordinator no longer counts."""
    d = await domain.restart(max_pending_per_tenant=8)
    (a,) = await in_other_groups(d, "t", 1)
    store, group = d.store, d.store.keys.group_of(a)
    share = store.keys.group(group).share("t")
    coordinator = store.keys.tenant("t")
    granted = await store.scripts.run("lease_take", [coordinator], "t", group, "p", 8, 8, 8)
    lease, ver = granted[3], granted[5]
    revoked = await store.scripts.run("lease_revoke", [coordinator], "t", group)
    kept = named(await store.scripts.run("lease_shrink", [share], "t", revoked[1], group=group))
    pairs = [x for kind in "bpru" for x in (kind, kept[kind])]
    await store.scripts.run("lease_settle", [coordinator], "t", group, kept["ver"], *pairs)
    late = await store.scripts.run("lease_set", [share], "t", "p", lease, ver, group=group)
    assert late[1] == b"stale"
    assert int(await store.redis.hget(share, "lp") or 0) == 0
    assert int(await store.redis.hget(coordinator, "sum_p") or 0) == 0  # all of it back
    for seq in range(1, 9):  # and the whole limit can be leased again
        await d.ledger.submit("t", a, seq, FORWARD, b"f", f"a{seq}")
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("t", a, 9, FORWARD, b"f", "a9")
    await d.notifier.stop()


async def test_byte_leases_over_groups_never_pass_the_limit_under_concurrent_admissions(
    domain: Domain,
) -> None:
    """Six runs in as many groups each submit payloads of 1-3 KiB in seq order, all at once,
    three times the tenant's payload-byte limit: what is admitted never passes it, the
    coordinator never leases more than it, no group holds more than it is counted for, and a
    refusal writes nothing. Once they finished, what the groups leased goes back: one
    payload of the whole limit is admitted in one group."""
    limit = 16 * 1024
    d = await domain.restart(
        max_pending_bytes_per_tenant=limit,
        max_registrations_per_tenant=64,
        admission_rate_per_tenant=0.0,  # the bytes refuse here, not the bucket
    )
    rids = await in_other_groups(d, "t", 6)

    async def client(i: int, rid: str) -> int:
        """Submit until refused (a client retries that seq_id); the bytes admitted."""
        used = 0
        for seq in range(1, 9):
            payload = b"x" * (1024 * (1 + (i + seq) % 3))
            try:
                await d.ledger.submit("t", rid, seq, FORWARD, payload, f"{rid}{seq}")
            except errors.ResourceExhausted as refused:
                assert "MAX_PENDING_BYTES_PER_TENANT" in refused.message
                assert not await d.client.exists(d.store.keys.op(f"{rid}#{seq}"))
                break
            used += len(payload)
        return used

    used = sum(await asyncio.gather(*(client(i, rid) for i, rid in enumerate(rids))))
    assert 0 < used <= limit
    assert (await d.ledger.tenant_load("t"))["pending_bytes"] == used  # exact
    raw = await d.client.hgetall(d.store.keys.tenant("t"))
    coordinator = {text(k): int(v) for k, v in raw.items()}
    groups = {d.store.keys.group_of(rid) for rid in rids}
    assert coordinator["sum_b"] <= limit
    assert coordinator["sum_b"] == sum(coordinator.get(f"b{g}", 0) for g in groups)
    for g in groups:
        share = await d.client.hmget(d.store.keys.group(g).share("t"), "pending_bytes", "lb")
        use, lease = (int(x or 0) for x in share)
        assert use <= lease <= coordinator.get(f"b{g}", 0)
    # Everything admitted finishes; then the whole limit fits one group.
    while claims := await d.claim_ready(64):
        for claim in claims:
            assert await d.ledger.complete(claim.operation_id, OpState.SUCCEEDED, b"r")
    assert (await d.ledger.tenant_load("t"))["pending_bytes"] == 0
    last = await d.ready_registration(tenant="t", session="st", seq=99)
    assert (await d.ledger.submit("t", last, 1, FORWARD, b"x" * limit, "whole")).state == (
        OpState.QUEUED
    )
    await d.notifier.stop()
