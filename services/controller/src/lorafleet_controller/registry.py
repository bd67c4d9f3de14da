"""The slot registry: registrations, trainer/rollout replicas, and fixed slot placement.

A registration (= Tinker training run, id `<session_id>:train:<model_seq_id>`) holds one
fixed slot on a trainer replica serving its base model for its whole life. When every slot
is taken it waits in a per-base-model queue (never evicting anyone). A trainer replica that
goes silent or restarts with a new incarnation loses its slots: its registrations become
UNAVAILABLE, their open operations fail clearly (REPLICA_LOST), and they re-enter the queue
ahead of new registrations; when a slot frees up (the replica returns, or another one serves
the base model) they are bound again and restored from their last saved state.

Operations after that state are not replayed (their payloads are dropped once they finish):
they were either reported failed at the loss, or their effect is gone with the replica, and
the registration's `unavailable_reason` during the outage says so.

All placement state is in Redis and every transition is a Lua script; this module also
drives the trainer side of a placement (BindSlot, LoadState for restores, UnbindSlot).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import PurePath

import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.clients import Pool
from lorafleet_controller.lua import Scripts

log = logging.getLogger(__name__)

TRAINER, ROLLOUT = "trainer", "rollout"


def _s(value: bytes | None, default: str = "") -> str:
    return value.decode() if value is not None else default


def base_model_name(name: str) -> str:
    """A base model served from a local folder is named by the folder, as trainers report it.

    Rollouts report the absolute path they loaded; HF hub names ("org/model") are kept.
    """
    return PurePath(name).name if name.startswith("/") else name


def registration_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


@dataclass(frozen=True)
class RegRecord:
    registration_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: common_pb2.LoraConfig
    state: str
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


ManifestLookup = Callable[[str], Awaitable[common_pb2.BlobRef | None]]


class Registry:
    def __init__(
        self,
        client: aioredis.Redis,
        scripts: Scripts,
        prefix: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.r = client
        self.scripts = scripts
        self.p = prefix
        self.clock = clock

    # --- registrations --------------------------------------------------------------------
    async def create(
        self,
        tenant: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: common_pb2.LoraConfig,
        user_metadata: dict[str, str],
        optimizer: str,
        with_initial_load: bool,
    ) -> tuple[RegRecord, bool]:
        """Create the registration (idempotent on its id). Returns (record, created)."""
        rid = registration_id(session_id, model_seq_id)
        created = await self.scripts.run(
            "create_reg", rid, tenant, session_id, self.clock(), 0 if with_initial_load else 1,
            "base_model", base_model, "lora", lora.SerializeToString(deterministic=True),
            "metadata", json.dumps(user_metadata, sort_keys=True), "optimizer", optimizer,
        )  # fmt: skip
        rec = await self.get(tenant, rid)
        if not created and rec.base_model != base_model:
            raise errors.Conflict(
                f"{rid} already exists with base model {rec.base_model!r}",
                field="base_model",
                reason="REGISTRATION_CONFLICT",
            )
        return rec, bool(created)

    async def get(self, tenant: str, rid: str) -> RegRecord:
        rec = await self.get_any(rid)
        if rec is None or rec.tenant != tenant:
            raise errors.NotFound(f"no registration {rid!r}", field="registration_id")
        return rec

    async def get_any(self, rid: str) -> RegRecord | None:
        raw = await self.r.hgetall(f"{self.p}reg:{rid}")
        if not raw:
            return None
        base = _s(raw.get(b"base_model"))
        position = 0
        state = _s(raw.get(b"state"))
        if state in ("queued", "unavailable"):
            rank = await self.r.zrank(f"{self.p}regq:{base}", rid)
            position = rank + 1 if rank is not None else 0
        slot = _s(raw.get(b"slot"), "-1")
        return RegRecord(
            registration_id=rid,
            tenant=_s(raw.get(b"tenant")),
            session_id=_s(raw.get(b"session_id")),
            base_model=base,
            lora=common_pb2.LoraConfig.FromString(raw.get(b"lora", b"")),
            state=state,
            replica=_s(raw.get(b"replica")),
            slot=int(slot) if slot else -1,
            queue_position=position,
            optim_steps=int(raw.get(b"optim_steps", b"0")),
            published_version=int(raw.get(b"published_version", b"0")),
            last_checkpoint=_s(raw.get(b"last_checkpoint")),
            created_at=float(raw.get(b"created_at", b"0")),
            last_request_time=float(raw.get(b"last_request_time", b"0")),
            user_metadata=json.loads(raw.get(b"metadata", b"{}")),
            unavailable_reason=_s(raw.get(b"unavailable_reason")),
            optimizer=_s(raw.get(b"optimizer")),
            head=int(raw.get(b"head", b"1")),
            max_seq=int(raw.get(b"max_seq", b"0")),
            pending=int(raw.get(b"pending", b"0")),
            dirty=raw.get(b"dirty") == b"1",
        )

    async def list(self, tenant: str, limit: int, offset: int) -> tuple[list[RegRecord], int]:
        key = f"{self.p}regs:{tenant}"
        total = int(await self.r.zcard(key))
        stop = offset + (limit if limit > 0 else 100) - 1
        ids = await self.r.zrevrange(key, offset, stop)
        recs = [await self.get_any(_s(i)) for i in ids]
        return [r for r in recs if r is not None], total

    async def all_ids(self) -> list[str]:
        return sorted(_s(x) for x in await self.r.smembers(f"{self.p}regs"))

    async def binding_ids(self) -> list[str]:
        return sorted(_s(x) for x in await self.r.smembers(f"{self.p}binding"))

    async def queued(self, base_model: str) -> list[str]:
        return [_s(x) for x in await self.r.zrange(f"{self.p}regq:{base_model}", 0, -1)]

    async def set_fields(self, rid: str, **values: str | int | float) -> None:
        await self.r.hset(f"{self.p}reg:{rid}", mapping=values)  # type: ignore[arg-type]

    async def place(self, rid: str) -> tuple[str, str, int]:
        """('placed'|'bound', replica, slot), ('queued', '', position) or ('retired', '', 0)."""
        rec = await self.get_any(rid)
        score = rec.created_at if rec is not None else self.clock()
        out = await self.scripts.run("place", rid, self.clock(), score)
        code = _s(out[0])
        if code in ("placed", "bound"):
            return code, _s(out[1]), int(out[2])
        if code == "queued":
            return code, "", int(out[1])
        return code, "", 0

    async def bound(self, rid: str, replica: str, slot: int) -> bool:
        return bool(await self.scripts.run("bound", rid, replica, slot, self.clock()))

    async def release(self, rid: str) -> tuple[str, int]:
        out = await self.scripts.run("release", rid)
        replica = _s(out[0])
        return replica, int(out[1]) if replica else -1

    # --- replicas -------------------------------------------------------------------------
    async def register_replica(self, rep: Replica) -> str:
        """Record a replica's announcement. Returns 'new', 'restarted', 'returned' or 'same'."""
        key = f"{self.p}replica:{rep.replica_id}"
        old = await self.r.hmget(key, "incarnation", "healthy", "kind")
        now = self.clock()
        if old[0] is None:
            change = "new"
        elif _s(old[0]) != rep.incarnation:
            change = "restarted"
            if _s(old[2]) == TRAINER:
                await self.replica_lost(
                    rep.replica_id, f"trainer replica {rep.replica_id} restarted (new incarnation)"
                )
        elif old[1] != b"1":
            change = "returned"
        else:
            change = "same"
        mapping: dict[str, str | int | float] = {
            "kind": rep.kind, "address": rep.address, "base_model": rep.base_model,
            "num_slots": rep.num_slots, "incarnation": rep.incarnation, "last_seen": now,
            "healthy": "1", "tokenizer_id": rep.tokenizer_id, "max_rank": rep.max_rank,
            "max_context_length": rep.max_context_length, "arch": rep.arch,
        }  # fmt: skip
        if rep.loss_fns:
            mapping["loss_fns"] = json.dumps(rep.loss_fns)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
            pipe.sadd(f"{self.p}replicas", rep.replica_id)
            pipe.sadd(f"{self.p}{rep.kind}s:{rep.base_model}", rep.replica_id)
            pipe.sadd(f"{self.p}base_models", rep.base_model)
            await pipe.execute()
        return change

    async def set_loss_fns(self, replica_id: str, loss_fns: list[str]) -> None:
        await self.r.hset(f"{self.p}replica:{replica_id}", "loss_fns", json.dumps(loss_fns))

    async def replica(self, replica_id: str) -> Replica | None:
        raw = await self.r.hgetall(f"{self.p}replica:{replica_id}")
        if not raw:
            return None
        return Replica(
            kind=_s(raw.get(b"kind")),
            replica_id=replica_id,
            address=_s(raw.get(b"address")),
            base_model=_s(raw.get(b"base_model")),
            num_slots=int(raw.get(b"num_slots", b"0")),
            incarnation=_s(raw.get(b"incarnation")),
            last_seen=float(raw.get(b"last_seen", b"0")),
            healthy=raw.get(b"healthy") == b"1",
            tokenizer_id=_s(raw.get(b"tokenizer_id")),
            max_rank=int(raw.get(b"max_rank", b"0") or 0),
            max_context_length=int(raw.get(b"max_context_length", b"0") or 0),
            arch=_s(raw.get(b"arch")),
            loss_fns=json.loads(raw.get(b"loss_fns", b"[]")),
        )

    async def replicas(
        self, kind: str | None = None, base_model: str | None = None
    ) -> list[Replica]:
        if base_model is not None and kind is not None:
            ids = await self.r.smembers(f"{self.p}{kind}s:{base_model}")
        else:
            ids = await self.r.smembers(f"{self.p}replicas")
        out = []
        for rid in sorted(_s(i) for i in ids):
            rep = await self.replica(rid)
            if rep is not None and (kind is None or rep.kind == kind):
                out.append(rep)
        return out

    async def slot_table(self, replica_id: str) -> dict[int, str]:
        raw = await self.r.hgetall(f"{self.p}slots:{replica_id}")
        return {int(k): _s(v) for k, v in raw.items()}

    async def replica_lost(self, replica_id: str, reason: str) -> list[str]:
        """Mark the replica unhealthy; its registrations become UNAVAILABLE and re-queue."""
        await self.r.hset(f"{self.p}replica:{replica_id}", "healthy", "0")
        out = await self.scripts.run("replica_lost", replica_id, self.clock(), reason)
        lost = [_s(x) for x in out]
        if lost:
            log.warning("%s: registrations %s are unavailable", reason, lost)
        return lost

    async def silent_replicas(self, silence: float) -> list[Replica]:
        cutoff = self.clock() - silence
        return [r for r in await self.replicas() if r.healthy and r.last_seen < cutoff]


class Placer:
    """Drives placements to completion on the trainers (bind, restore) and releases slots."""

    def __init__(self, registry: Registry, pool: Pool, manifest_for: ManifestLookup) -> None:
        self.registry = registry
        self.pool = pool
        self.manifest_for = manifest_for
        self._binding: set[str] = set()  # registrations with a binding attempt in flight

    async def fill(self, base_model: str) -> None:
        """Place queued registrations of a base model while free slots remain."""
        for rid in await self.registry.queued(base_model):
            code, _, _ = await self.registry.place(rid)
            if code == "queued":
                return
            if code == "placed":
                await self.finish_binding(rid)

    async def finish_binding(self, rid: str) -> None:
        """Bind (and restore) a placed registration on its trainer; retried by the sweeper.

        One attempt per registration at a time: two overlapping attempts (the create call
        and the sweeper) would see each other's bind, and the loser would unbind the slot
        the winner had just marked READY.
        """
        if rid in self._binding:
            return
        self._binding.add(rid)
        try:
            await self._finish_binding(rid)
        finally:
            self._binding.discard(rid)

    async def _finish_binding(self, rid: str) -> None:
        rec = await self.registry.get_any(rid)
        if rec is None or rec.state != "binding":
            return
        rep = await self.registry.replica(rec.replica)
        if rep is None or not rep.healthy:
            return
        trainer = self.pool.trainer(rep.address)
        try:
            intact = await self._prepare_slot(trainer, rec)
            if not intact:
                await trainer.bind(rec.slot, rid, rec.lora)
                restore = await self.registry.r.hget(f"{self.registry.p}reg:{rid}", "restore")
                if restore == b"1" and rec.last_checkpoint:
                    manifest = await self.manifest_for(rec.last_checkpoint)
                    if manifest is not None:
                        opid = f"{rid}#restore@{rep.replica_id}:{rep.incarnation}"
                        await trainer.load_state(opid, rec.slot, rid, manifest, True)
        except errors.LorafleetError as exc:
            log.warning("binding %s on %s failed (%s); will retry", rid, rep.replica_id, exc)
            return
        if not await self.registry.bound(rid, rep.replica_id, rec.slot):
            await self._unbind_quietly(rep.address, rec.slot, rid)

    async def _prepare_slot(self, trainer, rec: RegRecord) -> bool:  # type: ignore[no-untyped-def]
        """True when the trainer still holds this registration in this slot (state intact).

        Clears what the registry no longer owns: our registration in another slot, or
        another registration in our slot (the registry is the source of truth).
        """
        intact = False
        for info in await trainer.list_slots():
            if not info.registration_id:
                continue
            if info.registration_id == rec.registration_id and info.slot == rec.slot:
                intact = True
            elif info.registration_id == rec.registration_id or info.slot == rec.slot:
                await trainer.unbind(info.slot, info.registration_id)
        return intact

    async def retire(self, rid: str) -> None:
        replica, slot = await self.registry.release(rid)
        if replica:
            rep = await self.registry.replica(replica)
            if rep is not None and rep.healthy:
                await self._unbind_quietly(rep.address, slot, rid)
            base = (await self.registry.get_any(rid)).base_model  # type: ignore[union-attr]
            await self.fill(base)

    async def _unbind_quietly(self, address: str, slot: int, rid: str) -> None:
        try:
            await self.pool.trainer(address).unbind(slot, rid)
        except errors.LorafleetError as exc:
            log.warning("unbinding %s from slot %d at %s failed: %s", rid, slot, address, exc)
