"""Sessions against real Redis: expiry is leader work, so a deposed leader cannot finish one."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet_controller.store import StaleEpoch, Store
from lorafleet_controller.tenancy import Tenancy

from .conftest import Domain


async def test_a_deposed_leader_cannot_finish_a_session(domain: Domain) -> None:
    """The sweeper of a leader that lost its epoch (it still believes it leads) finds the
    session silent, but its finish is refused: the new leader, which may have heard from the
    session meanwhile, decides. A standby serving FinishSession holds no epoch and may."""
    old = Tenancy(domain.store, domain.clock)
    sid = await old.create_session("t1", [], {}, "", "", "")
    domain.clock.now += 120
    assert await old.silent_sessions(60) == [("t1", sid)]
    new_store = Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups)
    await new_store.take_epoch()
    with pytest.raises(StaleEpoch):
        await old.finish("t1", sid, "heartbeat timeout")
    assert not (await old.get("t1", sid)).finished
    assert await old.silent_sessions(60) == [("t1", sid)]  # still live, for the new leader

    await Tenancy(new_store, domain.clock).heartbeat("t1", sid)
    assert await old.silent_sessions(60) == []
    standby = Tenancy(
        Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups),
        domain.clock,
    )
    await standby.finish("t1", sid, "closed by the client")
    assert (await standby.get("t1", sid)).finished


async def test_a_finished_session_is_forgotten_after_its_retention(domain: Domain) -> None:
    """Finished sessions do not pile up in Redis (issue 36 item 4): once the retention has
    passed since it finished, a session's keys are gone (its record, its run and sampler
    lists, its entries in the tenant's and the key's sets), and the store holds what it held
    before the session was opened. A live session, however old, is never expired."""
    tenancy = Tenancy(domain.store, domain.clock)
    _, key_id = await tenancy.create_key("t1", "laptop")
    live = await tenancy.create_session("t1", [], {}, "", "", "", key_id=key_id)
    before = sorted(await domain.client.keys("*"))
    sid = await tenancy.create_session("t1", ["tag"], {"k": "v"}, "0.38", "", "", key_id=key_id)
    rid = await domain.ready_registration(session=sid)
    await tenancy.finish("t1", sid, "closed by the client")
    assert await tenancy.sessions_of_key(key_id) == [("t1", live)]  # off the key at once
    domain.clock.now += 99
    assert await tenancy.expire_finished(100) == 0
    assert (await tenancy.get("t1", sid)).training_run_ids == [rid]
    domain.clock.now += 1
    assert await tenancy.expire_finished(100) == 1
    with pytest.raises(errors.NotFound):
        await tenancy.get("t1", sid)
    assert await tenancy.list("t1", 10, 0) == ([live], 1)
    left = set(await domain.client.keys("*")) - set(before)
    session_keys = {k for k in left if sid.encode() in k and rid.encode() not in k}
    assert session_keys == set(), left  # the run's own keys stay
    assert (await domain.registry.get("t1", rid)).registration_id == rid
    domain.clock.now += 10**6
    assert await tenancy.expire_finished(100) == 0  # the live one stays
    assert not (await tenancy.get("t1", live)).finished
