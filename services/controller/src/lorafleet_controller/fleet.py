"""What the fleet can do and how it is doing: the capabilities and status views.

Both are read-only aggregations over the registry, built with batched reads (one pipeline
for every slot table, one for every registration shown) and one concurrent round of
ListAdapters to the rollouts, so their cost does not grow by a round trip per slot. The
status also reads every other registration (one more pipeline) to show the runs that need
an operator's eye: it is an admin call, not on any request's path.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from lorafleet import errors
from lorafleet.v1 import rollout_pb2
from lorafleet_controller.clients import Pool
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.registry import (
    ROLLOUT,
    TRAINER,
    Registry,
    RegRecord,
    Replica,
    sample_limit,
)
from lorafleet_controller.store import RegState
from lorafleet_controller.store.placement import HomesRepo


@dataclass
class BaseModelView:
    """One base model as the healthy replicas serving it describe it."""

    name: str
    tokenizer_id: str = ""
    arch: str = ""
    max_context_length: int = 0
    trainable: bool = False
    sampleable: bool = False
    max_rank: int = 0
    loss_fns: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    vocab_size: int = 0  # the trainers' (0 = none reported yet)
    max_num_samples: int = 0  # the least of the healthy rollouts' limits (0 = no rollout)
    quantization: str = ""  # its replicas' one setting (registration refuses a second)


@dataclass(frozen=True)
class ReplicaView:
    replica: Replica
    slots: list[RegRecord]  # a trainer's bound registrations, by slot
    adapters: list[str]  # a rollout's resident adapter ids (empty when it did not answer)
    loaded: int = 0  # how many of them are in its engine now
    homes: int = 0  # registrations placed on it (placement.py)


@dataclass(frozen=True)
class FleetView:
    ledger_depth: dict[str, int]
    replicas: list[ReplicaView]
    queued: list[RegRecord]  # registrations waiting for a trainer slot, in queue order
    attention: list[RegRecord]  # runs neither bound, queued nor simply retired (`notable`)
    attention_total: int  # how many there are (`attention` holds the newest ATTENTION_SHOWN)


# Enough to see what is wrong without a fleet of old failures flooding `lorafleet status`.
ATTENTION_SHOWN = 50


def notable(rec: RegRecord) -> bool:
    """A run an operator should see apart from the slot table and the queue: one in any
    state but bound, queued or retired (unavailable, paged: whatever the store records, so a
    new state shows without this knowing it), and a retired one that was corrupted or failed
    (a run retired because its session finished is routine)."""
    if rec.state == RegState.RETIRED:
        return bool(rec.corrupted or rec.failed)
    return not rec.placed and rec.state != RegState.QUEUED


class Fleet:
    def __init__(self, registry: Registry, ledger: Ledger, pool: Pool) -> None:
        self.registry = registry
        self.ledger = ledger
        self.pool = pool
        self.homes = HomesRepo(registry.store)

    async def capabilities(self) -> list[BaseModelView]:
        models: dict[str, BaseModelView] = {}
        replicas = await self.registry.replicas()
        for rep in replicas:
            if not rep.healthy:
                continue
            info = models.setdefault(rep.base_model, BaseModelView(rep.base_model))
            info.tokenizer_id = info.tokenizer_id or rep.tokenizer_id
            info.quantization = info.quantization or rep.quantization
            if rep.kind == TRAINER:  # a rollout's arch (its engine) only fills a gap
                info.arch = rep.arch
            else:
                info.arch = info.arch or rep.arch
            info.max_context_length = max(info.max_context_length, rep.max_context_length)
            if rep.kind == TRAINER:
                info.trainable = True
                info.max_rank = max(info.max_rank, rep.max_rank)
                info.loss_fns += [loss for loss in rep.loss_fns if loss not in info.loss_fns]
                info.modules = sorted(set(info.modules) | set(rep.modules))
                info.vocab_size = max(info.vocab_size, rep.vocab_size)
            elif rep.kind == ROLLOUT:
                info.sampleable = True
        for info in models.values():
            info.max_num_samples = sample_limit(
                [r for r in replicas if r.kind == ROLLOUT and r.base_model == info.name]
            )
        return [models[name] for name in sorted(models)]

    async def status(self) -> FleetView:
        replicas = await self.registry.replicas()
        trainers = [r for r in replicas if r.kind == TRAINER]
        rollouts = [r for r in replicas if r.kind != TRAINER]
        tables = await self.registry.slot_tables([r.replica_id for r in trainers])
        queued_ids: list[str] = []
        for base in dict.fromkeys(r.base_model for r in trainers):
            queued_ids += [rid for rid in await self.registry.queued(base) if rid not in queued_ids]
        slot_ids = [rid for r in trainers for _, rid in sorted(tables[r.replica_id].items())]
        records = await self.registry.get_many(slot_ids + queued_ids)
        by_id = {rec.registration_id: rec for rec in records if rec is not None}
        resident = await asyncio.gather(*(self._resident(r.address) for r in rollouts))
        adapters = {r.replica_id: held for r, held in zip(rollouts, resident, strict=True)}
        homes: Counter[str] = Counter()
        for base in dict.fromkeys(r.base_model for r in rollouts):
            homes.update((await self.homes.all(base)).values())
        views = []
        for rep in replicas:
            held = adapters.get(rep.replica_id, [])
            slots = [
                by_id[rid]
                for _, rid in sorted(tables.get(rep.replica_id, {}).items())
                if rid in by_id
            ]
            views.append(
                ReplicaView(
                    rep,
                    slots,
                    [a.adapter_id for a in held],
                    loaded=sum(1 for a in held if a.loaded),
                    homes=homes[rep.replica_id] if rep.kind != TRAINER else 0,
                )
            )
        queued = [by_id[rid] for rid in queued_ids if rid in by_id]
        others = [rid for rid in await self.registry.all_ids() if rid not in by_id]
        rest = [r for r in await self.registry.get_many(others) if r is not None]
        attention = [r for r in queued + rest if notable(r)]  # a waiting run may be unavailable
        attention.sort(key=lambda r: r.created_at, reverse=True)
        return FleetView(
            await self.ledger.depth(), views, queued, attention[:ATTENTION_SHOWN], len(attention)
        )

    async def _resident(self, address: str) -> list[rollout_pb2.ResidentAdapter]:
        try:
            return await self.pool.rollout(address).list_adapters(retry=False)
        except errors.LorafleetError:
            return []
