"""Room left in Redis: new work is refused before the server reaches its `maxmemory`.

Redis must run with `maxmemory` and `maxmemory-policy noeviction` (the chart's and
`lorafleet up`'s): an evicting policy would drop acknowledged operations, so a controller
refuses to start on one (`verify`). At `maxmemory` a noeviction server fails every write,
including the acknowledgements, completions and deletes that would free room, so the fleet
stops admitting before that: once `used_memory` reaches `full_fraction` of `maxmemory`,
new work (operations, samples, sessions, runs, jobs) is refused with a retryable 429
naming the store, while everything that finishes or frees work goes on. Each controller
reads the server every `interval` seconds in the background (`run`) and admission checks
the last reading, so the hot path gains no round trip. On a Cluster every master is read
and the fullest decides.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError as StoreError

from lorafleet import errors

log = logging.getLogger(__name__)

STORE_FULL = "STORE_FULL"


@dataclass(frozen=True)
class Reading:
    """One server's memory: `used` and `limit` in bytes (limit 0: no maxmemory)."""

    used: int
    limit: int
    policy: str

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit else 0.0


def readings(info: dict[str, Any]) -> list[Reading]:
    """`INFO memory` of one server, or a Cluster client's answer per node."""
    nodes = info.values() if info and all(isinstance(v, dict) for v in info.values()) else [info]
    return [
        Reading(
            int(node.get("used_memory", 0)),
            int(node.get("maxmemory", 0)),
            str(node.get("maxmemory_policy", "noeviction")),
        )
        for node in nodes
    ]


class Room:
    def __init__(self, client: Any, full_fraction: float = 0.9, interval: float = 1.0) -> None:
        self.client = client
        self.full_fraction = full_fraction
        self.interval = interval
        self.fullest = Reading(0, 0, "noeviction")  # the last reading (none yet: no limit)

    async def refresh(self) -> Reading:
        """Read the fullest server's memory now, and admit by it from now."""
        nodes = readings(await self.client.info("memory"))
        self.fullest = max(nodes, key=lambda r: (r.fraction, r.used))
        return self.fullest

    async def run(self) -> None:
        """Refresh every `interval` until cancelled; a failed read keeps the last one (Redis
        out of reach fails the admissions themselves)."""
        while True:
            try:
                await self.refresh()
            except StoreError as exc:
                log.warning("cannot read Redis's memory: %s", exc)
            await asyncio.sleep(self.interval)

    async def verify(self) -> Reading:
        """Refuse (FailedPrecondition) a server that would evict keys: it would lose
        acknowledged operations without an error. Takes the first reading."""
        for node in readings(await self.client.info("memory")):
            if node.limit and node.policy != "noeviction":
                raise errors.FailedPrecondition(
                    f"Redis evicts keys at maxmemory (maxmemory-policy {node.policy}): that "
                    "loses acknowledged operations; set maxmemory-policy noeviction",
                    field="redis_url",
                )
        return await self.refresh()

    def admit(self, what: str) -> None:
        """Raise a retryable ResourceExhausted while the last reading is fuller than
        `full_fraction` of maxmemory; `what` names the refused work in the message."""
        fullest = self.fullest
        if fullest.limit and fullest.fraction >= self.full_fraction:
            raise errors.ResourceExhausted(
                f"the fleet's store is {fullest.fraction:.0%} full ({fullest.used} of "
                f"{fullest.limit} bytes, refusing new work from {self.full_fraction:.0%}): "
                f"no {what} was admitted; retry once finished work is acknowledged and released",
                retry_after=max(self.interval, 1.0),
                field="store",
                reason=STORE_FULL,
            )
