"""The slot registry: registrations, trainer/rollout replicas, and fixed slot placement.

A registration (= Tinker training run, id `<session_id>:train:<model_seq_id>`) holds one
fixed slot on a trainer replica serving its base model while it is bound. When every slot
is taken it waits in a per-base-model queue (never evicting a busy run; an idle one is paged
out for it and back in on its next operation: paging.py). A trainer replica that
goes silent or restarts with a new incarnation loses its slots: its registrations become
UNAVAILABLE and re-enter the queue ahead of new registrations, their open operations stay
queued (the one in flight is queued again), and when a slot frees up (the replica returns,
or another one serves the base model) they are rebuilt there by replay from their last
snapshot (recovery.py) before anything else runs.

All placement state is in Redis and every transition is a Lua script; this module also
drives the trainer side of a placement (BindSlot, LoadState for restores, UnbindSlot).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import PurePath

from redis.typing import EncodableT, FieldT

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2
from lorafleet_controller import metrics
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.discovery.types import ROLLOUT, TRAINER
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import RegState, Store, named, text

log = logging.getLogger(__name__)

__all__ = ["ROLLOUT", "TRAINER", "Placement", "Placer", "RegRecord", "Registry", "Replica"]


def base_model_name(name: str) -> str:
    """A base model served from a local folder is named by the folder, as trainers report it.

    Rollouts report the absolute path they loaded; HF hub names ("org/model") are kept.
    """
    return PurePath(name).name if name.startswith("/") else name


def registration_id(session_id: str, model_seq_id: int) -> str:
    return str(contract.RunId(session_id, model_seq_id))


def terminal(exc: errors.LorafleetError) -> bool:
    """A bind failure retrying cannot fix: the trainer refused the run's config itself (an
    InvalidArgument naming a `lora_config` field; any trainer of the model would). Transport,
    lease, capacity and slot failures (a trainer restarted with fewer slots) are retried."""
    return isinstance(exc, errors.InvalidArgument) and exc.field.startswith("lora_config")


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


# Rebuilds a registration the registry marked for restore (its trainer was lost) in its newly
# placed slot; False when it cannot be rebuilt (it was retired as corrupted). recovery.py.
Restore = Callable[[TrainerClient, "RegRecord", "Replica"], Awaitable[bool]]
# Fails a registration whose bind cannot succeed: its calls end with the error, its slot is
# freed (Controller.fail_run).
Fail = Callable[[str, errors.LorafleetError], Awaitable[None]]


@dataclass(frozen=True)
class Placement:
    """The outcome of `Registry.place`: placed (or already bound) on a replica's slot,
    queued at a position, or retired."""

    code: str  # placed | bound | queued | capped | retired
    replica: str = ""
    slot: int = -1
    position: int = 0


class Registry:
    def __init__(
        self, store: Store, settings: ControllerSettings, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.settings = settings
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
        own = [
            self.keys.reg(rid),
            self.keys.tenant(tenant),
            self.keys.tenant_regs(tenant),
            self.keys.session_runs(session_id),
        ]
        out = named(
            await self.store.scripts.run(
                "create_reg",
                own,
                rid,
                tenant,
                session_id,
                self.clock(),
                0 if with_initial_load else 1,
                self.settings.max_registrations_per_tenant,
                "base_model",
                base_model,
                "lora",
                lora.SerializeToString(deterministic=True),
                "metadata",
                json.dumps(user_metadata, sort_keys=True),
                "optimizer",
                optimizer,
            )
        )
        code = text(out["code"])
        if code == "limit":
            raise errors.ResourceExhausted(
                f"tenant {tenant!r} has {self.settings.max_registrations_per_tenant} live "
                "training runs, the most it may hold; delete one or finish a session first",
                field="model_seq_id",
                reason="REGISTRATION_LIMIT",
                retry_after=5.0,
            )
        rec = await self.get(tenant, rid)
        if code == "exists" and rec.base_model != base_model:
            raise errors.Conflict(
                f"{rid} already exists with base model {rec.base_model!r}",
                field="base_model",
                reason="REGISTRATION_CONFLICT",
            )
        return rec, code == "created"

    async def get(self, tenant: str, rid: str) -> RegRecord:
        rec = await self.get_any(rid)
        if rec is None or rec.tenant != tenant:
            raise errors.NotFound(f"no registration {rid!r}", field="registration_id")
        return rec

    async def get_any(self, rid: str) -> RegRecord | None:
        (rec,) = await self.get_many([rid])
        return rec

    async def record_failure(self, rid: str, error: errors.LorafleetError) -> RegRecord | None:
        """Store why the run's trainer refused it (`RegRecord.failure`), before the run is
        fenced, so a submit racing the fence already sees it; the run as it now reads."""
        stored = contract.run_failure_json(rid, error)
        await self.store.redis.hset(self.keys.reg(rid), "failed", stored)
        return await self.get_any(rid)

    async def get_many(self, rids: list[str]) -> list[RegRecord | None]:
        """Several registrations in two round trips (records, then queue positions)."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.hgetall(self.keys.reg(rid))
            raws = await pipe.execute()
        queued = [
            (i, text(raw.get(b"base_model")))
            for i, raw in enumerate(raws)
            if raw and text(raw.get(b"state")) in _WAITING
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

    async def of_tenant(self, tenant: str, limit: int, offset: int) -> tuple[list[RegRecord], int]:
        """A page of the tenant's registrations, newest first, and their total."""
        key = self.keys.tenant_regs(tenant)
        total = int(await self.store.redis.zcard(key))
        stop = offset + (limit if limit > 0 else 100) - 1
        ids = [text(i) for i in await self.store.redis.zrevrange(key, offset, stop)]
        return [r for r in await self.get_many(ids) if r is not None], total

    async def all_ids(self) -> list[str]:
        return sorted(text(x) for x in await self.store.redis.smembers(self.keys.regs))

    async def binding_ids(self) -> list[str]:
        return sorted(text(x) for x in await self.store.redis.smembers(self.keys.binding))

    async def queued(self, base_model: str) -> list[str]:
        return [text(x) for x in await self.store.redis.zrange(self.keys.regq(base_model), 0, -1)]

    async def place(self, rid: str) -> Placement:
        """Place on a free slot (dispatch side: carries the leader epoch when it has one).
        `capped`: its tenant holds `max_slots_per_tenant` slots, so it waits."""
        out = named(
            await self.store.scripts.run(
                "place",
                [self.keys.reg(rid)],
                rid,
                self.clock(),
                self.settings.max_slots_per_tenant,
                epoch=self.store.epoch,
            )
        )
        code = text(out["code"])
        if code in ("placed", "bound"):
            return Placement(code, text(out["replica"]), int(out["slot"]))
        if code in ("queued", "capped"):
            return Placement(code, position=int(out["position"]))
        return Placement(code)

    async def bound(self, rid: str, replica: str, slot: int) -> bool:
        out = named(
            await self.store.scripts.run(
                "bound",
                [self.keys.reg(rid)],
                rid,
                replica,
                slot,
                self.clock(),
                epoch=self.store.epoch,
            )
        )
        return text(out["code"]) == "ok"

    async def release(self, rid: str) -> tuple[str, int, str]:
        """Retire the placement: (replica, slot) freed ('', -1 when none) and the base model."""
        out = named(await self.store.scripts.run("release", [self.keys.reg(rid)], rid))
        replica = text(out["replica"])
        return replica, int(out["slot"]) if replica else -1, text(out["base_model"])

    # --- replicas -------------------------------------------------------------------------
    async def register_replica(self, rep: Replica) -> str:
        """Record a replica's announcement. Returns 'new', 'restarted', 'returned' or 'same'."""
        key = self.keys.replica(rep.replica_id)
        old = await self.store.redis.hmget(key, "incarnation", "healthy", "kind")
        now = self.clock()
        if old[0] is None:
            change = "new"
        elif text(old[0]) != rep.incarnation:
            change = "restarted"
            if text(old[2]) == TRAINER:
                await self.replica_lost(
                    rep.replica_id, f"trainer replica {rep.replica_id} restarted (new incarnation)"
                )
        elif old[1] != b"1":
            change = "returned"
        else:
            change = "same"
        mapping: dict[FieldT, EncodableT] = {
            "kind": rep.kind,
            "address": rep.address,
            "base_model": rep.base_model,
            "num_slots": rep.num_slots,
            "incarnation": rep.incarnation,
            "last_seen": now,
            "healthy": "1",
            "tokenizer_id": rep.tokenizer_id,
            "max_rank": rep.max_rank,
            "max_context_length": rep.max_context_length,
            "arch": rep.arch,
            "quantization": rep.quantization,
            "max_num_samples": rep.max_num_samples,
            "failed": "",
        }
        if rep.loss_fns:
            mapping["loss_fns"] = json.dumps(rep.loss_fns)
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.sadd(self.keys.replicas, rep.replica_id)
            pipe.sadd(self.keys.pool(rep.kind, rep.base_model), rep.replica_id)
            pipe.sadd(self.keys.base_models, rep.base_model)
            await pipe.execute()
        return change

    async def set_trainer_info(
        self, replica_id: str, loss_fns: list[str], modules: list[str], vocab_size: int
    ) -> None:
        """What a trainer's GetTrainerInfo adds to its announcement (capabilities)."""
        await self.store.redis.hset(
            self.keys.replica(replica_id),
            mapping={
                "loss_fns": json.dumps(loss_fns),
                "modules": json.dumps(modules),
                "vocab_size": vocab_size,
            },
        )

    async def replica(self, replica_id: str) -> Replica | None:
        (rep,) = await self._replicas([replica_id])
        return rep

    async def _replicas(self, ids: list[str]) -> list[Replica | None]:
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.hgetall(self.keys.replica(replica_id))
            raws = await pipe.execute()
        return [_replica(i, raw) if raw else None for i, raw in zip(ids, raws, strict=True)]

    async def replicas(
        self, kind: str | None = None, base_model: str | None = None
    ) -> list[Replica]:
        if base_model is not None and kind is not None:
            ids = await self.store.redis.smembers(self.keys.pool(kind, base_model))
        else:
            ids = await self.store.redis.smembers(self.keys.replicas)
        reps = await self._replicas(sorted(text(i) for i in ids))
        return [r for r in reps if r is not None and (kind is None or r.kind == kind)]

    async def slot_table(self, replica_id: str) -> dict[int, str]:
        raw = await self.store.redis.hgetall(self.keys.slots(replica_id))
        return {int(k): text(v) for k, v in raw.items()}

    async def slot_tables(self, replica_ids: list[str]) -> dict[str, dict[int, str]]:
        """Several replicas' slot tables in one round trip."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.hgetall(self.keys.slots(replica_id))
            raws = await pipe.execute()
        return {
            replica_id: {int(k): text(v) for k, v in raw.items()}
            for replica_id, raw in zip(replica_ids, raws, strict=True)
        }

    async def replica_lost(self, replica_id: str, reason: str) -> list[str]:
        """Mark the replica unhealthy; a trainer's registrations become UNAVAILABLE and
        re-queue. Returns them."""
        out = named(
            await self.store.scripts.run(
                "replica_lost",
                [self.keys.replica(replica_id), self.keys.slots(replica_id)],
                replica_id,
                self.clock(),
                reason,
                epoch=self.store.epoch,
            )
        )
        lost = [text(x) for x in out["affected"]]
        if text(out["code"]) == "lost":
            log.warning("%s%s", reason, f": registrations {lost} are unavailable" if lost else "")
        return lost

    async def replica_failed(self, replica_id: str, reason: str) -> Replica:
        """Record that a replica's process stays down and why (its supervisor gave up on it),
        and lose it (`replica_lost`). The reason stays until the replica registers again."""
        rep = await self.replica(replica_id)
        if rep is None:
            raise errors.NotFound(f"no replica {replica_id!r}", field="replica_id")
        await self.store.redis.hset(self.keys.replica(replica_id), "failed", reason)
        await self.replica_lost(replica_id, f"{rep.kind} replica {replica_id} failed: {reason}")
        return rep

    async def silent_replicas(self, silence: float) -> list[Replica]:
        cutoff = self.clock() - silence
        return [r for r in await self.replicas() if r.healthy and r.last_seen < cutoff]


# States whose queue position is reported (a PAGED run is in the queue once it has work).
_WAITING = (RegState.QUEUED, RegState.UNAVAILABLE, RegState.PAGED)


def sample_limit(rollouts: list[Replica]) -> int:
    """The largest num_samples every healthy rollout accepts (0: none has said): a request
    must be valid on whichever rollout serves it."""
    limits = [r.max_num_samples for r in rollouts if r.healthy and r.max_num_samples]
    return min(limits, default=0)


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


class Placer:
    """Drives placements to completion on the trainers (bind, restore) and releases slots."""

    def __init__(self, registry: Registry, pool: Pool, restore: Restore, fail: Fail) -> None:
        self.registry = registry
        self.pool = pool
        self.restore = restore
        self.fail = fail
        self._binding: set[str] = set()  # registrations with a binding attempt in flight

    async def fill(self, base_model: str) -> None:
        """Place queued registrations of a base model while free slots remain, oldest
        waiting first (one whose tenant is at its cap is passed over), then bind them all
        at once: a page-in's restore does not wait for another's."""
        placed = []
        for rid in await self.registry.queued(base_model):
            placement = await self.registry.place(rid)
            if placement.code == "queued":
                break
            if placement.code == "placed":
                placed.append(rid)
        await asyncio.gather(*(self.finish_binding(rid) for rid in placed))

    async def finish_binding(self, rid: str) -> None:
        """Bind (and restore) a placed registration on its trainer; retried by the sweeper,
        unless the trainer refuses the config itself (`terminal`): then the run fails.

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
        if rec is None or rec.state != RegState.BINDING:
            return
        rep = await self.registry.replica(rec.replica)
        if rep is None or not rep.healthy:
            return
        trainer = self.pool.trainer(rep.address)
        start = time.perf_counter()
        try:
            intact = await self._prepare_slot(trainer, rec)
            if rec.restore:
                if not await self.restore(trainer, rec, rep):
                    return
            elif not intact:
                await trainer.bind(rec.slot, rid, rec.lora)
        except errors.LorafleetError as exc:
            if terminal(exc):  # retrying would wait forever: fail the run and its callers now
                log.warning(
                    "binding %s on %s refused (%s): the run fails", rid, rep.replica_id, exc
                )
                await self.fail(rid, exc)
                return
            log.warning("binding %s on %s failed (%s); will retry", rid, rep.replica_id, exc)
            return
        if not await self.registry.bound(rid, rep.replica_id, rec.slot):
            await self.unbind_quietly(rep.address, rec.slot, rid)
        elif rec.restore and rec.paged_at:
            seconds = time.perf_counter() - start
            metrics.PAGE_INS.inc()
            metrics.PAGE_IN_SECONDS.observe(seconds)
            log.info(
                "paged in %s in %.3fs on %s slot %d (paged out %.1fs)",
                rid,
                seconds,
                rep.replica_id,
                rec.slot,
                self.registry.clock() - rec.paged_at,
            )

    async def _prepare_slot(self, trainer: TrainerClient, rec: RegRecord) -> bool:
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
        replica, slot, base_model = await self.registry.release(rid)
        if replica:
            rep = await self.registry.replica(replica)
            if rep is not None and rep.healthy:
                await self.unbind_quietly(rep.address, slot, rid)
            await self.fill(base_model)

    async def unbind_quietly(self, address: str, slot: int, rid: str) -> None:
        """Clear the trainer's slot; a failure is only logged (the next bind of the slot
        clears what the registry no longer owns: `_prepare_slot`)."""
        try:
            await self.pool.trainer(address).unbind(slot, rid)
        except errors.LorafleetError as exc:
            log.warning("unbinding %s from slot %d at %s failed: %s", rid, slot, address, exc)
