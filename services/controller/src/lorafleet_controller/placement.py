"""Which rollout replica is a registration's home: where its versions are published and where
its samples go.

Capacity grows with replicas only if each replica holds a share of the adapters rather than
all of them, so every registration has one home rollout (per base model). A home is chosen
when the registration first publishes, or again when its home is gone: the healthy rollout
with the fewest homes for its capacity (`num_slots`, the versions it keeps loaded), ties
broken by rendezvous hashing on (registration, replica), so placement is balanced to within
one registration per replica and the same on every controller for the same table.

A home is advice, never a correctness rule. A version is pinned by its id on every replica
and any replica can load any live version from the checkpoint store, so a stale or missing
home costs one load on the first sample there, never a wrong or failed answer. That is why
homes live in one plain Redis hash any controller may write (store/placement.py) and why the
functions here are pure: they turn a table into a decision.

A hot home spreads: when its rollout already has `spread_at` samples in flight from this
controller and another healthy rollout has fewer, the sample goes to the least loaded one,
which loads the version once and then serves it from its cache.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence

from lorafleet_controller.store.replicas import Replica

__all__ = ["choose_home", "rebalance", "route"]


def _affinity(rid: str, replica_id: str) -> int:
    """A stable pseudo-random rank of a replica for a registration (rendezvous hashing)."""
    digest = hashlib.sha256(f"{rid}\0{replica_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _capacity(rep: Replica) -> int:
    return max(rep.num_slots, 1)


def choose_home(rid: str, rollouts: Sequence[Replica], homes: Mapping[str, str]) -> Replica:
    """The rollout `rid` should live on: fewest homes per unit of capacity (not counting
    `rid` itself), then the highest rendezvous rank. `rollouts` are the healthy ones."""
    if not rollouts:
        raise ValueError("no rollout to place on")
    counts = Counter(home for other, home in homes.items() if other != rid)
    return min(
        rollouts,
        key=lambda r: (
            (counts[r.replica_id] + 1) / _capacity(r),
            -_affinity(rid, r.replica_id),
            r.replica_id,
        ),
    )


def route(
    home: Replica, rollouts: Sequence[Replica], load: Mapping[str, int], spread_at: int
) -> Replica:
    """Where one sample runs: its home, unless the home has `spread_at` or more samples in
    flight and another healthy rollout has fewer (then the least loaded of them)."""
    if load.get(home.replica_id, 0) < spread_at:
        return home
    least = min(rollouts, key=lambda r: (load.get(r.replica_id, 0), r.replica_id))
    return least if load.get(least.replica_id, 0) < load.get(home.replica_id, 0) else home


def rebalance(homes: Mapping[str, str], rollouts: Sequence[Replica]) -> dict[str, str]:
    """Moves (registration → new home) that even out the homes per unit of capacity over the
    healthy `rollouts`, one at a time from the most loaded to the least loaded while a move
    leaves the pair closer: a replica that joined gets its share and no registration moves
    between the others. Homes on replicas not in `rollouts` stay (they are chosen again
    when next used)."""
    placed: dict[str, list[str]] = {r.replica_id: [] for r in rollouts}
    for rid, home in sorted(homes.items()):
        if home in placed:
            placed[home].append(rid)
    capacity = {r.replica_id: _capacity(r) for r in rollouts}
    moves: dict[str, str] = {}
    while len(placed) > 1:
        ratio = {rep: len(rids) / capacity[rep] for rep, rids in placed.items()}
        most = max(placed, key=lambda rep: (ratio[rep], rep))
        least = min(placed, key=lambda rep: (ratio[rep], rep))
        after_most = (len(placed[most]) - 1) / capacity[most]
        after_least = (len(placed[least]) + 1) / capacity[least]
        if after_least >= ratio[most] or after_most < ratio[least] or not placed[most]:
            return moves
        rid = max(placed[most], key=lambda x: _affinity(x, least))
        placed[most].remove(rid)
        placed[least].append(rid)
        moves[rid] = least
    return moves
