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

All placement state is in Redis and every transition is a Lua script, both owned by the
store's repositories (store/registrations.py, store/replicas.py); this module keeps the rules
(limits, conflicts, when a restarted trainer is lost) and drives the trainer side of a
placement (BindSlot, LoadState for restores, UnbindSlot).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import PurePath

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2
from lorafleet_controller import metrics
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.discovery.types import ROLLOUT, TRAINER
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import RegState, Store
from lorafleet_controller.store.registrations import (
    PLACED,
    WAITING,
    NewRegistration,
    Placement,
    RegistrationsRepo,
    RegRecord,
)
from lorafleet_controller.store.replicas import Replica, ReplicasRepo

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


# Rebuilds a registration the registry marked for restore (its trainer was lost) in its newly
# placed slot; False when it cannot be rebuilt (it was retired as corrupted). recovery.py.
Restore = Callable[[TrainerClient, "RegRecord", "Replica"], Awaitable[bool]]
# Fails a registration whose bind cannot succeed: its calls end with the error, its slot is
# freed (flows.runs.Runs.fail).
Fail = Callable[[str, errors.LorafleetError], Awaitable[None]]


class Registry:
    """The rules of registrations and replicas (limits, conflicts, the tenant's view, when a
    replica is lost); their records and transitions are the store's repositories."""

    def __init__(
        self, store: Store, settings: ControllerSettings, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.regs = RegistrationsRepo(store, clock)
        self.reps = ReplicasRepo(store)
        self.settings = settings
        self.clock = clock
        # placement changes seen cut off at the previous repair (repair_placements)
        self._suspects: set[tuple[str, str, int]] = set()

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
        new = NewRegistration(
            rid, tenant, session_id, base_model, lora, user_metadata, optimizer, with_initial_load
        )
        self.store.room.admit("training run")
        code = await self.regs.create(new, self.clock(), self.settings.max_registrations_per_tenant)
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

    async def paged_out(
        self, rid: str, replica: str, slot: int, base_model: str, waiting: bool
    ) -> None:
        """The fleet's half of a page-out (page_end.lua was the run's): its slot is free, and
        it waits for another when operations came meanwhile."""
        await self.regs.fleet_slot(
            rid, replica, slot, base_model, "wait" if waiting else "", self.clock()
        )

    async def wait_for_slot(self, rid: str, base_model: str) -> None:
        """A paged run has work again: it joins its base model's queue (page-in)."""
        await self.regs.fleet_slot(rid, "", -1, base_model, "wait", self.clock())

    async def repair_placements(self) -> None:
        """Finish placement changes a controller died in the middle of, between a run's
        group step and the fleet's (store/registrations.py): a slot entry whose run does not
        hold it is revoked in the run's group, then freed; a waiting run (QUEUED, UNAVAILABLE,
        or PAGED with work) in no queue is queued; a retired run still counted among its
        tenant's live runs leaves them. Only what two calls in a row found (the
        sweeper's, seconds apart), so a change in flight (milliseconds) is left alone."""
        found: set[tuple[str, str, int]] = set()
        trainers = [r.replica_id for r in await self.replicas(TRAINER)]
        tables = await self.slot_tables(trainers)
        entries = [(rep, slot, rid) for rep, t in tables.items() for slot, rid in t.items()]
        holders = await self.get_many([rid for _, _, rid in entries])
        for (rep, slot, rid), rec in zip(entries, holders, strict=True):
            if rec is not None and rec.state in PLACED and (rec.replica, rec.slot) == (rep, slot):
                continue
            if (rid, rep, slot) not in self._suspects:
                found.add((rid, rep, slot))
            elif await self.regs.revoke_slot(rid, rep, slot):
                log.warning("freeing %s slot %d, left to %s by a cut-off change", rep, slot, rid)
                await self.regs.fleet_slot(rid, rep, slot, rec.base_model if rec else "")
        for rec in await self.get_many(await self.all_ids()):
            if rec is not None and rec.state == RegState.RETIRED:
                # retired in its group, cut off before it left its tenant's live runs
                if await self.regs.is_live(rec.registration_id, rec.tenant):
                    await self.regs.retired(rec.registration_id, rec.tenant)
                continue
            if rec is None or rec.queue_position or rec.state not in WAITING:
                continue
            if rec.state == RegState.PAGED and not rec.pending:
                continue
            if (rec.registration_id, "", -1) not in self._suspects:
                found.add((rec.registration_id, "", -1))
                continue
            score = {
                RegState.UNAVAILABLE: rec.created_at - 1e10,
                RegState.PAGED: self.clock(),
            }.get(rec.state, rec.created_at)
            log.warning("queueing %s again, left out by a cut-off change", rec.registration_id)
            await self.regs.fleet_slot(rec.registration_id, "", -1, rec.base_model, "wait", score)
        self._suspects = found

    async def sweep_reservations(self) -> int:
        """Finish or undo creations whose creator died between their steps."""
        return await self.regs.sweep_reservations(self.clock())

    async def expire_retired(self, retention_seconds: float, limit: int = 1000) -> int:
        """Forget up to `limit` runs retired `retention_seconds` ago or longer that have no
        checkpoint left (the leader's sweep); how many. A run with checkpoints stays until
        they are deleted or expire: sampling one takes a version of the run's counter."""
        cutoff = self.clock() - retention_seconds
        forgotten = 0
        for rid in await self.regs.retired_before(cutoff, limit):
            rec = await self.get_any(rid)  # gone: its fleet step already ran, a sweep cut off
            tenant, base = (rec.tenant, rec.base_model) if rec else ("", "")
            code = await self.regs.forget(rid, tenant, base, cutoff)
            forgotten += code == "forgotten"
        return forgotten

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
        await self.regs.set_failed(rid, contract.run_failure_json(rid, error))
        return await self.get_any(rid)

    async def get_many(self, rids: list[str]) -> list[RegRecord | None]:
        """Several registrations in two round trips (records, then queue positions)."""
        return await self.regs.get_many(rids)

    async def of_tenant(self, tenant: str, limit: int, offset: int) -> tuple[list[RegRecord], int]:
        """A page of the tenant's registrations, newest first, and their total."""
        ids, total = await self.regs.of_tenant(tenant, offset, limit if limit > 0 else 100)
        return [r for r in await self.get_many(ids) if r is not None], total

    async def all_ids(self) -> list[str]:
        return await self.regs.all_ids()

    async def binding_ids(self) -> list[str]:
        return await self.regs.binding_ids()

    async def queued(self, base_model: str) -> list[str]:
        return await self.regs.queued(base_model)

    async def place(self, rid: str) -> Placement:
        """Place on a free slot (dispatch side: carries the leader epoch when it has one).
        `capped`: its tenant holds `max_slots_per_tenant` slots, so it waits."""
        return await self.regs.place(rid, self.clock(), self.settings.max_slots_per_tenant)

    async def bound(self, rid: str, replica: str, slot: int) -> bool:
        return await self.regs.bound(rid, replica, slot, self.clock())

    async def release(self, rid: str) -> tuple[str, int, str]:
        """Retire the placement: (replica, slot) freed ('', -1 when none) and the base model."""
        return await self.regs.release(rid)

    # --- replicas -------------------------------------------------------------------------
    async def register_replica(self, rep: Replica) -> str:
        """Record a replica's announcement. Returns 'new', 'restarted', 'returned' or 'same'.
        A trainer that restarted (a new incarnation) lost its slots: it is lost first."""
        old = await self.replica(rep.replica_id)
        now = self.clock()
        if old is not None and old.incarnation != rep.incarnation and old.kind == TRAINER:
            await self.replica_lost(
                rep.replica_id, f"trainer replica {rep.replica_id} restarted (new incarnation)"
            )
        return await self.reps.register(rep, now)

    async def set_trainer_info(
        self, replica_id: str, loss_fns: list[str], modules: list[str], vocab_size: int
    ) -> None:
        """What a trainer's GetTrainerInfo adds to its announcement (capabilities)."""
        await self.reps.set_trainer_info(replica_id, loss_fns, modules, vocab_size)

    async def replica(self, replica_id: str) -> Replica | None:
        (rep,) = await self.reps.get_many([replica_id])
        return rep

    async def replicas(
        self, kind: str | None = None, base_model: str | None = None
    ) -> list[Replica]:
        reps = await self.reps.get_many(await self.reps.ids(kind, base_model))
        return [r for r in reps if r is not None and (kind is None or r.kind == kind)]

    async def slot_table(self, replica_id: str) -> dict[int, str]:
        return (await self.slot_tables([replica_id]))[replica_id]

    async def slot_tables(self, replica_ids: list[str]) -> dict[str, dict[int, str]]:
        """Several replicas' slot tables in one round trip."""
        return await self.reps.slot_tables(replica_ids)

    async def replica_lost(self, replica_id: str, reason: str) -> list[str]:
        """Mark the replica unhealthy; a trainer's registrations become UNAVAILABLE and
        re-queue. Returns them."""
        lost = await self.reps.lost(replica_id, self.clock(), reason)
        for entry in lost.slots:  # the fleet's half: free the entry, queue the run ahead
            await self.regs.fleet_slot(
                entry.rid,
                replica_id,
                entry.slot,
                entry.base_model,
                "ahead" if entry.lost else "",
                entry.score,
            )
        if lost.code == "lost":
            unavailable = f": registrations {lost.affected} are unavailable"
            log.warning("%s%s", reason, unavailable if lost.affected else "")
        return lost.affected

    async def replica_failed(self, replica_id: str, reason: str) -> Replica:
        """Record that a replica's process stays down and why (its supervisor gave up on it),
        and lose it (`replica_lost`). The reason stays until the replica registers again."""
        rep = await self.replica(replica_id)
        if rep is None or not await self.reps.mark_failed(replica_id, reason):
            raise errors.NotFound(f"no replica {replica_id!r}", field="replica_id")
        await self.replica_lost(replica_id, f"{rep.kind} replica {replica_id} failed: {reason}")
        return rep

    async def silent_replicas(self, silence: float) -> list[Replica]:
        cutoff = self.clock() - silence
        return [r for r in await self.replicas() if r.healthy and r.last_seen < cutoff]


def sample_limit(rollouts: list[Replica]) -> int:
    """The largest num_samples every healthy rollout accepts (0: none has said): a request
    must be valid on whichever rollout serves it."""
    limits = [r.max_num_samples for r in rollouts if r.healthy and r.max_num_samples]
    return min(limits, default=0)


class Placer:
    """Drives placements to completion on the trainers (bind, restore) and releases slots."""

    def __init__(self, registry: Registry, pool: Pool, restore: Restore, fail: Fail) -> None:
        self.registry = registry
        self.pool = pool
        self.restore = restore
        self.fail = fail
        self._binding: set[str] = set()  # registrations with a binding attempt in flight

    async def queue_page_in(self, rid: str, base_model: str) -> None:
        """A paged run has work again: it waits for a slot (fill places it)."""
        await self.registry.wait_for_slot(rid, base_model)

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
