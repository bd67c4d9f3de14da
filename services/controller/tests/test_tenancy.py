"""Sessions against real Redis: expiry is leader work, so a deposed leader cannot finish one."""

from __future__ import annotations

import pytest

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
