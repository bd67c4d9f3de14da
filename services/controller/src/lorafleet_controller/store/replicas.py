"""Trainer and rollout replicas in Redis: every read and write of a replica's record, the
pools and the slot tables (registry.py holds the rules and calls this).

A replica is a hash (`replica`); `replicas` lists every one, `trainers` / `rollouts` (`pool`)
the ones of a kind serving a base model, `base_models` every model announced, and `slots` a
trainer's slot number → registration id (written only by the placement scripts).

Every write that touches more than one key, or checks before it writes, is one script:
`replica_register` (the announcement, its pools, and what changed since the last one, in one
step), `replica_failed` (only a known replica) and `replica_lost`. A trainer's capabilities
(GetTrainerInfo) are fields of its own record, a plain write.

Fencing: `replica_lost` carries the epoch of a controller that leads (`Store.epoch`), so a
deposed leader's sweeper cannot take the slots of a replica the new leader hears from.
Announcements and failure reports are requests any replica serves, never fenced.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from lorafleet_controller.store import Store, named, text


@dataclass(frozen=True)
class Replica:
    kind: str
    replica_id: str
    address: str
    base_model: str
    num_slots: int
    incarnation: str
    last_seen: float
    healthy: bool
    tokenizer_id: str = ""
    max_rank: int = 0
    max_context_length: int = 0
    arch: str = ""
    loss_fns: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # a trainer's adaptable modules
    vocab_size: int = 0  # a trainer's (GetTrainerInfo); 0 = not reported yet
    max_num_samples: int = 0  # a rollout's limit on one request's num_samples
    quantization: str = "none"  # how it stores the base (lorafleet.quantize); one per model
    failed: str = ""  # why its process stays down (ReportReplicaFailed); cleared when it returns


@dataclass(frozen=True)
class LostSlot:
    """One slot entry of a lost trainer after its run's group step (reg_lost.lua): `lost`
    when the run became unavailable with it (to queue at `score`), else it had left it."""

    rid: str
    slot: int
    lost: bool
    base_model: str
    score: float


@dataclass(frozen=True)
class Lost:
    """The outcome of losing a replica: code = lost | unknown | already (was not healthy),
    and its slot entries, each lost in its run's group (the caller frees them in the fleet)."""

    code: str
    slots: list[LostSlot]

    @property
    def affected(self) -> list[str]:
        """The registrations that became unavailable with it."""
        return [s.rid for s in self.slots if s.lost]


class ReplicasRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def register(self, rep: Replica, now: float) -> str:
        """Record an announcement, seen at `now` and healthy: 'new', 'restarted' (another
        incarnation), 'returned' (was unhealthy) or 'same'."""
        fields: list[str | int] = [
            "address",
            rep.address,
            "num_slots",
            rep.num_slots,
            "tokenizer_id",
            rep.tokenizer_id,
            "max_rank",
            rep.max_rank,
            "max_context_length",
            rep.max_context_length,
            "arch",
            rep.arch,
            "quantization",
            rep.quantization,
            "max_num_samples",
            rep.max_num_samples,
        ]
        if rep.loss_fns:
            fields += ["loss_fns", json.dumps(rep.loss_fns)]
        out = named(
            await self.store.scripts.run(
                "replica_register",
                [self.keys.replica(rep.replica_id), self.keys.pool(rep.kind, rep.base_model)],
                rep.replica_id,
                rep.kind,
                rep.base_model,
                rep.incarnation,
                now,
                *fields,
            )
        )
        return text(out["change"])

    async def set_trainer_info(
        self, replica_id: str, loss_fns: list[str], modules: list[str], vocab_size: int
    ) -> None:
        await self.store.redis.hset(
            self.keys.replica(replica_id),
            mapping={
                "loss_fns": json.dumps(loss_fns),
                "modules": json.dumps(modules),
                "vocab_size": vocab_size,
            },
        )

    async def mark_failed(self, replica_id: str, reason: str) -> bool:
        """Record why a known replica's process stays down; False (nothing written) when
        there is no such replica."""
        out = named(
            await self.store.scripts.run(
                "replica_failed", [self.keys.replica(replica_id)], replica_id, reason
            )
        )
        return text(out["code"]) == "ok"

    async def lost(self, replica_id: str, now: float, reason: str) -> Lost:
        """Mark it unhealthy, then lose each slot entry in its run's group (concurrently): the
        runs become UNAVAILABLE (replica_lost.lua, reg_lost.lua); the caller frees the
        entries and queues the runs. Fenced while this controller leads. Entries left by an
        earlier call that died half-way are lost now too, whatever the first step's code."""
        epoch = self.store.epoch
        out = named(
            await self.store.scripts.run(
                "replica_lost",
                [self.keys.replica(replica_id), self.keys.slots(replica_id)],
                replica_id,
                epoch=epoch,
            )
        )
        flat = [text(x) for x in out["slots"]]
        entries = sorted(zip(flat[::2], flat[1::2], strict=True), key=lambda e: int(e[0]))

        async def lose(slot: str, rid: str) -> LostSlot:
            lost = named(
                await self.store.scripts.run(
                    "reg_lost",
                    [self.keys.reg(rid)],
                    replica_id,
                    slot,
                    rid,
                    now,
                    reason,
                    epoch=epoch,
                    group=self.keys.group_of(rid),
                )
            )
            return LostSlot(
                rid,
                int(slot),
                text(lost["code"]) == "lost",
                text(lost["base_model"]),
                float(lost["score"]),
            )

        slots = await asyncio.gather(*(lose(slot, rid) for slot, rid in entries))
        return Lost(text(out["code"]), list(slots))

    async def get_many(self, ids: list[str]) -> list[Replica | None]:
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.hgetall(self.keys.replica(replica_id))
            raws = await pipe.execute()
        return [_replica(i, raw) if raw else None for i, raw in zip(ids, raws, strict=True)]

    async def ids(self, kind: str | None = None, base_model: str | None = None) -> list[str]:
        """The replicas of `kind` serving `base_model` when both are given, else every one;
        sorted."""
        if base_model is not None and kind is not None:
            raw = await self.store.redis.smembers(self.keys.pool(kind, base_model))
        else:
            raw = await self.store.redis.smembers(self.keys.replicas)
        return sorted(text(i) for i in raw)

    async def slot_tables(self, replica_ids: list[str]) -> dict[str, dict[int, str]]:
        """Several trainers' slot tables (slot → registration id) in one round trip."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.hgetall(self.keys.slots(replica_id))
            raws = await pipe.execute()
        return {
            replica_id: {int(k): text(v) for k, v in raw.items()}
            for replica_id, raw in zip(replica_ids, raws, strict=True)
        }


def _replica(replica_id: str, raw: dict[bytes, bytes]) -> Replica:
    return Replica(
        kind=text(raw.get(b"kind")),
        replica_id=replica_id,
        address=text(raw.get(b"address")),
        base_model=text(raw.get(b"base_model")),
        num_slots=int(raw.get(b"num_slots", b"0")),
        incarnation=text(raw.get(b"incarnation")),
        last_seen=float(raw.get(b"last_seen", b"0")),
        healthy=raw.get(b"healthy") == b"1",
        tokenizer_id=text(raw.get(b"tokenizer_id")),
        max_rank=int(raw.get(b"max_rank", b"0") or 0),
        max_context_length=int(raw.get(b"max_context_length", b"0") or 0),
        arch=text(raw.get(b"arch")),
        loss_fns=json.loads(raw.get(b"loss_fns", b"[]")),
        modules=json.loads(raw.get(b"modules", b"[]")),
        vocab_size=int(raw.get(b"vocab_size", b"0") or 0),
        max_num_samples=int(raw.get(b"max_num_samples", b"0") or 0),
        quantization=text(raw.get(b"quantization")) or "none",
        failed=text(raw.get(b"failed")),
    )
