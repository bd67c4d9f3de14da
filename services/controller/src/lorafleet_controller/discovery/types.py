"""The discovery interface: what the controller needs to know about each replica."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

TRAINER, ROLLOUT = "trainer", "rollout"
KINDS = (TRAINER, ROLLOUT)


@dataclass(frozen=True, order=True)
class Endpoint:
    """One replica: its kind, stable id (the pod name), gRPC address and readiness."""

    kind: str
    replica_id: str
    address: str
    ready: bool


class Discovery(Protocol):
    """A source of the current replica set.

    `snapshot()` answers once; `watch()` yields the full, sorted list first and then again
    after every change, until the consumer stops iterating (or cancels).
    """

    async def snapshot(self) -> list[Endpoint]: ...

    def watch(self) -> AsyncIterator[list[Endpoint]]: ...
