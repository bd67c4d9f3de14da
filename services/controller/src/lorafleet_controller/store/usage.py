"""The per-tenant usage totals in Redis: every read and write of the usage family (usage.py).

Totals are a hash per tenant (`usage`), and `usage_tenants` lists the tenants that have any.
Two writers add to them: the ledger's `complete` script counts an operation's usage with its
outcome (not here: it is part of recording that outcome), and `add_residency` bills the
seconds registrations held trainer slots. `stored_bytes` is no total: it is read from the
catalog's records of the tenant's checkpoints (their `size`) whenever totals are read.

Fencing: `add_residency` is the leader's sweeper at work, so it carries the leader's epoch and
a deposed leader that still ticks is refused (StaleEpoch) instead of billing the same seconds
as the new leader. Reads are plain commands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet_controller.store import Store, text


@dataclass(frozen=True)
class UsageTotals:
    """One tenant's totals (usage.py says what each counts); zeros when it has none."""

    tenant: str
    tokens_trained: int
    tokens_forward: int
    tokens_sampled: int
    tokens_prompt: int
    optim_steps: int
    adapter_seconds: float
    stored_bytes: int


class UsageRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def add_residency(self, slot_holders: Sequence[str], seconds: float) -> None:
        """Add `seconds` of adapter_seconds to the tenant of each registration in
        `slot_holders` (one entry per occupied slot), in one fenced script per group."""
        by_group: dict[int, list[str]] = {}
        for rid in slot_holders:
            by_group.setdefault(self.keys.group_of(rid), []).append(rid)
        epoch = self.store.leader_epoch()
        await asyncio.gather(
            *(
                self.store.scripts.run(
                    "usage_residency",
                    [self.keys.reg(rid) for rid in rids],
                    seconds,
                    *rids,
                    epoch=epoch,
                    group=group,
                )
                for group, rids in by_group.items()
            )
        )

    async def tenants(self) -> list[str]:
        """Every tenant with any usage counted (in any group), sorted."""
        tenants: set[str] = set()
        for group in self.keys.all_groups():
            tenants.update(text(t) for t in await self.store.redis.smembers(group.usage_tenants))
        return sorted(tenants)

    async def totals(self, tenants: Sequence[str]) -> list[UsageTotals]:
        """The totals of `tenants`, in that order: each the sum of its groups' counts."""
        groups = self.keys.all_groups()
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for t in tenants:
                for group in groups:
                    pipe.hgetall(group.usage(t))
            per_group = await pipe.execute()
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for t in tenants:
                pipe.zrange(self.keys.tenant_ckpts(t), 0, -1)
            paths = await pipe.execute()
        counts = []
        for i in range(len(tenants)):
            summed: dict[str, float] = {}
            for fields in per_group[i * len(groups) : (i + 1) * len(groups)]:
                for k, v in fields.items():
                    summed[text(k)] = summed.get(text(k), 0.0) + float(v)  # exact below 2**53
            counts.append(summed)
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for ps in paths:
                for p in ps:
                    pipe.hget(self.keys.ckpt(text(p)), "size")
            sizes = iter(await pipe.execute())
        out = []
        for t, f, ps in zip(tenants, counts, paths, strict=True):
            out.append(
                UsageTotals(
                    tenant=t,
                    tokens_trained=int(f.get("tokens_trained", 0)),
                    tokens_forward=int(f.get("tokens_forward", 0)),
                    tokens_sampled=int(f.get("tokens_sampled", 0)),
                    tokens_prompt=int(f.get("tokens_prompt", 0)),
                    optim_steps=int(f.get("optim_steps", 0)),
                    adapter_seconds=float(f.get("adapter_seconds", 0)),
                    stored_bytes=sum(int(text(next(sizes)) or 0) for _ in ps),
                )
            )
        return out
