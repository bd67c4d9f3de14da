"""Home rollouts in Redis (placement.py holds the rules): one hash per base model,
registration id → replica id.

Plain single-key reads and writes, neither scripted nor fenced: a home is advice (any
replica can load any live version), so two controllers racing to place the same
registration cost at most one extra load, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet_controller.store import Store, text


class HomesRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def all(self, base_model: str) -> dict[str, str]:
        raw = await self.store.redis.hgetall(self.keys.homes(base_model))
        return {text(k): text(v) for k, v in raw.items()}

    async def get(self, base_model: str, rid: str) -> str:
        """`rid`'s home replica id; '' when it has none."""
        return text(await self.store.redis.hget(self.keys.homes(base_model), rid))

    async def set(self, base_model: str, homes: Mapping[str, str]) -> None:
        if homes:
            mapping: dict[Any, Any] = dict(homes)
            await self.store.redis.hset(self.keys.homes(base_model), mapping=mapping)

    async def forget(self, base_model: str, rid: str) -> None:
        await self.store.redis.hdel(self.keys.homes(base_model), rid)
