"""Which batch rows this rank computes, and how ranks combine what they computed.

One engine serves a single process and every rank of a trainer group (group.py); the
difference is only this object. `Single` is the one-process case: it holds every row and
its collectives are identities. A group's `GroupShare` (group.py) gives each rank a
contiguous share of the sorted batch, sums the LoRA gradients over ranks and gathers the
per-datum results, so every rank ends a forward_backward with the same gradients and
outputs as one process would.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

# A cut may move to the nearest slot boundary when that keeps each side within this share
# of a rank's ideal token count: a whole slot is one group of rows, so one rank class unit
# (a plain mm) instead of two partial groups.
SLOT_SLACK = 0.1


def balance(lengths: list[int], slots: Sequence[Hashable], world: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, one per rank, balanced by token count.

    `lengths` are the rows' token counts in batch order and `slots` their slot (equal slots
    are consecutive). Cut k goes to the row boundary whose cumulative tokens are nearest to
    k/world of the total, or to the nearest slot boundary when that is within SLOT_SLACK of
    a rank's ideal share. Every range is non-empty while there are at least `world` rows.
    """
    n = len(lengths)
    cum = [0]
    for length in lengths:
        cum.append(cum[-1] + length)
    ideal = cum[-1] / world
    slot_edges = [i for i in range(n + 1) if i in (0, n) or slots[i] != slots[i - 1]]
    cuts = [0]
    for k in range(1, world):
        low = min(cuts[-1] + 1, n) if n >= world else cuts[-1]
        high = max(low, n - (world - k)) if n >= world else n
        target = k * ideal

        def miss(i: int, target: float = target) -> float:
            return abs(cum[i] - target)

        best = min(range(low, high + 1), key=miss)
        edges = [e for e in slot_edges if low <= e <= high]
        if edges:
            edge = min(edges, key=miss)
            if miss(edge) <= SLOT_SLACK * ideal:
                best = edge
        cuts.append(best)
    cuts.append(n)
    return list(itertools.pairwise(cuts))


class RowShare(Protocol):
    rank: int
    world: int

    def share(self, lengths: list[int], slots: Sequence[Hashable]) -> tuple[int, int]:
        """This rank's [first, last) range of the batch's rows (sorted by slot)."""
        ...

    def sum_gradients(self, flat: torch.Tensor) -> None:
        """Sum `flat` over ranks, in place."""
        ...

    def gather(self, local: Any) -> list[Any]:
        """Every rank's `local`, in rank order."""
        ...


class Single:
    """One process: every row is this rank's, and there is nothing to combine."""

    rank = 0
    world = 1

    def share(self, lengths: list[int], slots: Sequence[Hashable]) -> tuple[int, int]:
        return 0, len(lengths)

    def sum_gradients(self, flat: torch.Tensor) -> None:
        """Sums `flat` over ranks in place (nothing to sum with one)."""

    def gather(self, local: Any) -> list[Any]:
        """Every rank's `local`, in rank order."""
        return [local]
