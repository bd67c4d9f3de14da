"""The tenant's and the fleet's limits leased to the groups (store/quota.py), on one
redis-server in 8 groups and on the Cluster in 1: the use summed over the groups never
passes a limit, and what one group leased and no longer uses goes to another at its limit."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet.v1 import controller_pb2
from lorafleet_controller.store import OpState

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
    granted = await store.scripts.run("lease_take", [coordinator], "t", group, "p", 8, 8)
    lease, ver = granted[3], granted[5]
    revoked = await store.scripts.run("lease_revoke", [coordinator], "t", group)
    kept = await store.scripts.run("lease_shrink", [share], "t", revoked[1], group=group)
    await store.scripts.run("lease_settle", [coordinator], "t", group, kept[1], kept[3], kept[5])
    late = await store.scripts.run("lease_set", [share], "t", "p", lease, ver, group=group)
    assert late[1] == b"stale"
    assert int(await store.redis.hget(share, "lp") or 0) == 0
    assert int(await store.redis.hget(coordinator, "sum_p") or 0) == 0  # all of it back
    for seq in range(1, 9):  # and the whole limit can be leased again
        await d.ledger.submit("t", a, seq, FORWARD, b"f", f"a{seq}")
    with pytest.raises(errors.ResourceExhausted):
        await d.ledger.submit("t", a, 9, FORWARD, b"f", "a9")
    await d.notifier.stop()
