"""Registrations in Redis: every read and write of a training run's record and placement
(registry.py holds the rules and calls this).

A registration is a hash (`reg`); `regs` lists every one, `tenant_regs` a tenant's by creation
time, `session_runs` a session's, `binding` the placed ones whose trainer has not confirmed
the slot yet, and `regq` a base model's waiting ones in the order they get a slot.

Every transition is one script, or a few in a fixed order where it spans the run's group
and the fleet (store/keys.py): creating is `reg_reserve` (fleet: the id, counted against
its tenant's live runs), `create_reg` (the record, in the run's group), `reg_created`
(fleet: the reservation kept); retiring (`release`, or a fence) is the group's change, then
`reg_retired` (fleet: out of the tenant's live runs). Each step is idempotent, and the sweep
finishes or undoes a reservation left by a creator that died between the steps
(`sweep_reservations`). `place`, `bound` and `release` change a slot's holder with the
registration. Recording why a trainer refused a run is one field of its own record, a
plain write.

Fencing: `place` and `bound` carry the epoch of a controller that leads (`Store.epoch`; None
on one that does not), so a deposed leader's sweeper cannot place or confirm a run the new
leader has moved; creating and releasing are requests any replica serves, never fenced.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.store import RegState, Store, named, text

# A reservation whose record has not come after this long is undone by the sweep (its
# creator died between the steps); a creator slower than half of it starts again.
RESERVATION_GRACE_SECONDS = 60.0


PLACED = (RegState.BINDING, RegState.READY, RegState.PAGING)


@dataclass(frozen=True)
class RegRecord:
    registration_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: common_pb2.LoraConfig
    state: RegState
    replica: str
    slot: int
    queue_position: int
    optim_steps: int
    published_version: int
    last_checkpoint: str
    created_at: float
    last_request_time: float
    user_metadata: dict[str, str]
    unavailable_reason: str
    optimizer: str
    head: int
    max_seq: int
    pending: int
    dirty: bool
    restore: bool
    corrupted: str  # what a lost trainer took that replay could not rebuild (recovery.py)
    failed: str = ""  # why the trainer refused to bind it (Placer.fail), as error JSON
    last_done: float = 0.0  # when its last ordered operation ended
    paged_at: float = 0.0  # when it was paged out, while PAGED and until restored (paging.py)
    bound_at: float = 0.0  # when its trainer confirmed the slot it holds or last held

    def failure(self) -> errors.LorafleetError | None:
        """The error every call on a failed run ends with (None unless it failed)."""
        return contract.run_failure(self.failed) if self.failed else None

    @property
    def placed(self) -> bool:
        """Holds a trainer slot (bound, binding, or being paged out)."""
        return self.state in (RegState.READY, RegState.BINDING, RegState.PAGING)

    @property
    def last_active(self) -> float:
        """When it last submitted an operation or had one end (paging's idleness)."""
        return max(self.last_request_time, self.last_done)


@dataclass(frozen=True)
class NewRegistration:
    """What creating a registration records (the script adds its state and counters)."""

    registration_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: common_pb2.LoraConfig
    user_metadata: dict[str, str]
    optimizer: str
    with_initial_load: bool  # its ledger starts at seq_id 0 (the initial load), else 1


@dataclass(frozen=True)
class Placement:
    """The outcome of placing a registration: placed (or already bound) on a replica's slot,
    queued at a position, or retired."""

    code: str  # placed | bound | queued | capped | retired
    replica: str = ""
    slot: int = -1
    position: int = 0


# States whose queue position is reported (a PAGED run is in the queue once it has work).
WAITING = (RegState.QUEUED, RegState.UNAVAILABLE, RegState.PAGED)


class RegistrationsRepo:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.keys = store.keys
        self.clock = clock

    async def create(self, new: NewRegistration, now: float, max_per_tenant: int) -> str:
        """Create it unless it exists: 'created', 'exists', or 'limit' (its tenant holds
        `max_per_tenant` live registrations; nothing written)."""
        rid, tenant = new.registration_id, new.tenant
        started = time.monotonic()
        reserved = named(
            await self.store.scripts.run(
                "reg_reserve",
                [self.keys.tenant_live(tenant), self.keys.tenant_regs(tenant)],
                rid,
                tenant,
                new.session_id,
                now,
                max_per_tenant,
            )
        )
        if text(reserved["code"]) == "limit":
            return "limit"
        if time.monotonic() - started > RESERVATION_GRACE_SECONDS / 2:
            # the sweep may undo a reservation this old: start again rather than race it
            raise errors.Unavailable(f"creating {rid} stalled; try again", field="registration_id")
        out = named(
            await self.store.scripts.run(
                "create_reg",
                [self.keys.reg(rid)],
                rid,
                tenant,
                new.session_id,
                now,
                0 if new.with_initial_load else 1,
                "base_model",
                new.base_model,
                "lora",
                new.lora.SerializeToString(deterministic=True),
                "metadata",
                json.dumps(new.user_metadata, sort_keys=True),
                "optimizer",
                new.optimizer,
                group=self.keys.group_of(rid),
            )
        )
        await self.store.scripts.run("reg_created", [], rid)
        return text(out["code"])

    async def retired(self, rid: str, tenant: str) -> None:
        """A run retired in its group leaves its tenant's live runs and is queued to be
        forgotten after the retention (fleet; idempotent)."""
        await self.store.scripts.run(
            "reg_retired", [self.keys.tenant_live(tenant)], rid, tenant, self.clock()
        )

    async def retired_before(self, cutoff: float, limit: int) -> list[str]:
        """Up to `limit` runs retired at or before `cutoff`, oldest first."""
        raw = await self.store.redis.zrangebyscore(
            self.keys.runs_retired, "-inf", cutoff, start=0, num=limit
        )
        return [text(x) for x in raw]

    async def forget(self, rid: str, tenant: str, base_model: str, cutoff: float) -> str:
        """Forget a run retired at or before `cutoff` (the leader's sweep, fenced): its
        fleet records, then its record in its group, then its place in the queue.
        forgotten | kept (checkpoints of it are left) | waiting (its operation records are
        still being purged, or it retired after `cutoff`) | gone."""
        fleet = named(
            await self.store.scripts.run(
                "run_forget",
                [self.keys.tenant_regs(tenant), self.keys.run_ckpts(rid)],
                rid,
                tenant,
                cutoff,
                self.clock(),
                base_model,
                epoch=self.store.leader_epoch(),
            )
        )
        code = text(fleet["code"])
        if code != "forgotten":
            return code
        group = named(
            await self.store.scripts.run(
                "reg_forget",
                [self.keys.reg(rid), self.keys.replay(rid)],
                rid,
                epoch=self.store.leader_epoch(),
                group=self.keys.group_of(rid),
            )
        )
        code = text(group["code"])
        if code == "purging":
            return "waiting"
        await self.store.redis.zrem(self.keys.runs_retired, rid)
        return code  # forgotten, or live: never retired in its group, so not queued

    async def is_live(self, rid: str, tenant: str) -> bool:
        return bool(await self.store.redis.sismember(self.keys.tenant_live(tenant), rid))

    async def live_count(self, tenant: str) -> int:
        """The tenant's registrations not retired (what its limit counts)."""
        return int(await self.store.redis.scard(self.keys.tenant_live(tenant)))

    async def sweep_reservations(self, now: float) -> int:
        """Reservations older than RESERVATION_GRACE_SECONDS: kept where the record exists
        (its creator died before `reg_created`), undone where it never came. Returns how
        many were undone."""
        undone = 0
        for rid, raw in (await self.store.redis.hgetall(self.keys.reserving)).items():
            at = json.loads(raw)["at"]
            if now - at < RESERVATION_GRACE_SECONDS:
                continue
            if await self.store.redis.exists(self.keys.reg(text(rid))):
                await self.store.scripts.run("reg_created", [], text(rid))
            else:
                out = named(await self.store.scripts.run("reg_unreserve", [], text(rid), at))
                undone += text(out["code"]) == "undone"
        return undone

    async def set_failed(self, rid: str, error_json: str) -> None:
        """Record why the run's trainer refused it (`RegRecord.failed`)."""
        await self.store.redis.hset(self.keys.reg(rid), "failed", error_json)

    async def get_many(self, rids: list[str]) -> list[RegRecord | None]:
        """Several registrations in two round trips (records, then queue positions)."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.hgetall(self.keys.reg(rid))
            raws = await pipe.execute()
        queued = [
            (i, text(raw.get(b"base_model")))
            for i, raw in enumerate(raws)
            if raw and text(raw.get(b"state")) in WAITING
        ]
        ranks: list[int | None] = []
        if queued:
            async with self.store.redis.pipeline(transaction=False) as pipe:
                for i, base in queued:
                    pipe.zrank(self.keys.regq(base), rids[i])
                ranks = await pipe.execute()
        positions = {
            i: (rank + 1 if rank is not None else 0)
            for (i, _), rank in zip(queued, ranks, strict=True)
        }
        return [
            _record(rid, raw, positions.get(i, 0)) if raw else None
            for i, (rid, raw) in enumerate(zip(rids, raws, strict=True))
        ]

    async def of_tenant(self, tenant: str, offset: int, count: int) -> tuple[list[str], int]:
        """`count` of the tenant's registration ids from `offset`, newest first, and how many
        it has in all."""
        key = self.keys.tenant_regs(tenant)
        total = int(await self.store.redis.zcard(key))
        ids = await self.store.redis.zrevrange(key, offset, offset + count - 1)
        return [text(i) for i in ids], total

    async def all_ids(self) -> list[str]:
        return sorted(text(x) for x in await self.store.redis.smembers(self.keys.regs))

    async def binding_ids(self) -> list[str]:
        ids: set[str] = set()
        for group in self.keys.all_groups():
            ids.update(text(x) for x in await self.store.redis.smembers(group.binding))
        return sorted(ids)

    async def queued(self, base_model: str) -> list[str]:
        """The base model's waiting registrations, the next to get a slot first."""
        return [text(x) for x in await self.store.redis.zrange(self.keys.regq(base_model), 0, -1)]

    async def place(self, rid: str, now: float, cap: int) -> Placement:
        """Place on a free slot or queue (fenced while this controller leads). `capped`: its
        tenant holds `cap` slots of the base model's trainers, so it waits.

        Three steps: the run is read in its group, the slot (or its queue place) is taken in
        the fleet (place.lua), and the run takes the slot in its group if it still waits at
        the generation read first (accept_place.lua); refused, the slot is freed and the run
        read again (another placement, or a retirement, came first)."""
        group = self.keys.group_of(rid)
        while True:
            state, base, replica, slot, created_at, tenant, gen = await self.store.redis.hmget(
                self.keys.reg(rid),
                "state",
                "base_model",
                "replica",
                "slot",
                "created_at",
                "tenant",
                "gen",
            )
            st = text(state)
            if not st or st == RegState.RETIRED:
                return Placement("retired")
            if st in PLACED and text(replica):
                return Placement("bound", text(replica), int(text(slot)))
            out = named(
                await self.store.scripts.run(
                    "place",
                    [self.keys.regq(text(base))],
                    rid,
                    text(tenant),
                    text(base),
                    now if st == RegState.PAGED else float(text(created_at)),
                    cap,
                    epoch=self.store.epoch,
                )
            )
            code = text(out["code"])
            if code != "placed":
                return Placement(code, position=int(out["position"]))
            placement = Placement(code, text(out["replica"]), int(out["slot"]))
            accepted = named(
                await self.store.scripts.run(
                    "accept_place",
                    [self.keys.reg(rid)],
                    rid,
                    placement.replica,
                    placement.slot,
                    int(gen or 0),
                    epoch=self.store.epoch,
                    group=group,
                )
            )
            if text(accepted["code"]) == "placed":
                return placement
            await self.fleet_slot(rid, placement.replica, placement.slot, text(base))

    async def revoke_slot(self, rid: str, replica: str, slot: int) -> bool:
        """A slot entry the run does not hold: its placement generation moves on unless it
        holds it now (revoke_slot.lua). True when the entry may be freed."""
        out = named(
            await self.store.scripts.run(
                "revoke_slot",
                [self.keys.reg(rid)],
                rid,
                replica,
                slot,
                epoch=self.store.epoch,
                group=self.keys.group_of(rid),
            )
        )
        return text(out["code"]) == "revoked"

    async def fleet_slot(
        self, rid: str, replica: str, slot: int, base: str, queue: str = "", score: float = 0
    ) -> bool:
        """The fleet's half of a placement change after the run's group step: free its slot
        entry if it still holds it, and `queue` it ('leave', 'wait', 'ahead'; see
        fleet_slot.lua). True when the entry was freed."""
        out = named(
            await self.store.scripts.run(
                "fleet_slot",
                [self.keys.regq(base)],
                rid,
                replica,
                slot,
                base,
                queue,
                score,
                epoch=self.store.epoch,
            )
        )
        return text(out["code"]) == "freed"

    async def bound(self, rid: str, replica: str, slot: int, now: float) -> bool:
        """The trainer confirmed the slot (fenced while this controller leads); False when
        the placement changed meanwhile."""
        out = named(
            await self.store.scripts.run(
                "bound",
                [self.keys.reg(rid)],
                rid,
                replica,
                slot,
                now,
                epoch=self.store.epoch,
                group=self.keys.group_of(rid),
            )
        )
        return text(out["code"]) == "ok"

    async def release(self, rid: str) -> tuple[str, int, str]:
        """Retire the placement: (replica, slot) freed ('', -1 when none) and the base model.
        The run retires in its group first, then leaves the fleet's slot, queue and its
        tenant's live runs; the sweep finishes what a release cut off between left."""
        out = named(
            await self.store.scripts.run(
                "release", [self.keys.reg(rid)], rid, group=self.keys.group_of(rid)
            )
        )
        replica, base = text(out["replica"]), text(out["base_model"])
        slot = int(text(out["slot"]) or -1)
        freed = await self.fleet_slot(rid, replica, slot, base, "leave")
        if text(out["tenant"]):
            await self.retired(rid, text(out["tenant"]))
        return (replica, slot, base) if freed else ("", -1, base)


def _record(rid: str, raw: dict[bytes, bytes], position: int) -> RegRecord:
    slot = text(raw.get(b"slot"), "-1")
    return RegRecord(
        registration_id=rid,
        tenant=text(raw.get(b"tenant")),
        session_id=text(raw.get(b"session_id")),
        base_model=text(raw.get(b"base_model")),
        lora=common_pb2.LoraConfig.FromString(raw.get(b"lora", b"")),
        state=RegState(text(raw.get(b"state"))),
        replica=text(raw.get(b"replica")),
        slot=int(slot) if slot else -1,
        queue_position=position,
        optim_steps=int(raw.get(b"optim_steps", b"0")),
        published_version=int(raw.get(b"published_version", b"0")),
        last_checkpoint=text(raw.get(b"last_checkpoint")),
        created_at=float(raw.get(b"created_at", b"0")),
        last_request_time=float(raw.get(b"last_request_time", b"0")),
        user_metadata=json.loads(raw.get(b"metadata", b"{}")),
        unavailable_reason=text(raw.get(b"unavailable_reason")),
        optimizer=text(raw.get(b"optimizer")),
        head=int(raw.get(b"head", b"1")),
        max_seq=int(raw.get(b"max_seq", b"0")),
        pending=int(raw.get(b"pending", b"0")),
        dirty=raw.get(b"dirty") == b"1",
        restore=raw.get(b"restore") == b"1",
        corrupted=text(raw.get(b"corrupted")),
        failed=text(raw.get(b"failed")),
        bound_at=float(raw.get(b"bound_at", b"0")),
        last_done=float(raw.get(b"last_done", b"0")),
        paged_at=float(raw.get(b"paged_at", b"0")),
    )
