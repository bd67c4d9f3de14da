"""Placement rules (placement.py): balance by capacity, stability, spreading."""

from __future__ import annotations

from collections import Counter

from lorafleet_controller.placement import choose_home, rebalance, route
from lorafleet_controller.store.replicas import Replica


def rollout(replica_id: str, slots: int = 16) -> Replica:
    return Replica("rollout", replica_id, f"{replica_id}:1", "base", slots, "inc", 0.0, True)


def place_all(rids: list[str], rollouts: list[Replica]) -> dict[str, str]:
    homes: dict[str, str] = {}
    for rid in rids:
        homes[rid] = choose_home(rid, rollouts, homes).replica_id
    return homes


RIDS = [f"sess-{i}:train:0" for i in range(100)]


def test_homes_are_balanced_by_capacity() -> None:
    even = place_all(RIDS, [rollout("r0"), rollout("r1"), rollout("r2")])
    assert sorted(Counter(even.values()).values()) == [33, 33, 34]
    weighted = place_all(RIDS, [rollout("big", 48), rollout("small", 16)])
    assert Counter(weighted.values()) == {"big": 75, "small": 25}


def test_a_placed_registration_keeps_its_home() -> None:
    rollouts = [rollout("r0"), rollout("r1")]
    homes = place_all(RIDS, rollouts)
    for rid in RIDS:  # asking again (another publish, another controller) changes nothing
        assert choose_home(rid, rollouts, homes).replica_id == homes[rid]


def test_a_joining_replica_takes_only_its_share() -> None:
    homes = place_all(RIDS, [rollout("r0"), rollout("r1")])
    moves = rebalance(homes, [rollout("r0"), rollout("r1"), rollout("r2")])
    assert set(moves.values()) == {"r2"}  # nothing moves between the old replicas
    after = {**homes, **moves}
    assert sorted(Counter(after.values()).values()) == [33, 33, 34]
    assert rebalance(after, [rollout("r0"), rollout("r1"), rollout("r2")]) == {}


def test_a_lost_home_is_replaced_by_the_least_loaded_survivor() -> None:
    homes = place_all(RIDS, [rollout("r0"), rollout("r1"), rollout("r2")])
    survivors = [rollout("r0"), rollout("r1")]
    orphans = [rid for rid, home in homes.items() if home == "r2"]
    for rid in orphans:
        homes[rid] = choose_home(rid, survivors, homes).replica_id
    assert sorted(Counter(homes.values()).values()) == [50, 50]


def test_a_hot_home_spreads_to_a_less_loaded_rollout() -> None:
    r0, r1 = rollout("r0"), rollout("r1")
    assert route(r0, [r0, r1], {"r0": 3}, spread_at=4) == r0
    assert route(r0, [r0, r1], {"r0": 4, "r1": 1}, spread_at=4) == r1
    assert route(r0, [r0, r1], {"r0": 4, "r1": 4}, spread_at=4) == r0  # none less loaded
