"""Paging: a run without a slot still makes progress.

A trainer has a fixed number of LoRA slots and a registration holds one while it is bound.
When registrations wait for a slot of a base model and a bound run of it is idle (no open
operation, no submission and no result for `page_idle_seconds`), the pager pages that run out:
the trainer saves the slot's exact state (adapter, Adam moments, step count, applied operation
ids; dropout masks are a function of the LoRA seed, the step count and the datum ordinal, which
is 0 between steps) to the checkpoint store, the replay log records it as the run's snapshot,
the registration becomes PAGED and its slot goes to the oldest waiting run. The next operation
of a PAGED run (submit.lua) queues it for a slot again, and once placed it is restored like a
lost trainer's run (recovery.py): a fresh bind, the snapshot loaded, nothing to replay. The
SDK sees only latency: operations queue meanwhile and keep their order and ids.
`page_out(rid)` (PageOutRegistration, `lorafleet page-out RUN`) pages a run out at once,
waiting only for its operation in flight. A run with un-stepped gradients cannot be saved by
the trainer: it is refused, or with `replay=True` (`--force`) paged out all the same and
restored by replay from its last snapshot, as after a trainer loss. The sweep's idle
page-outs always take that way: a client that ran forward_backward and went quiet (sampling
before its optim_step, or gone until its session expires) would otherwise hold its slot
while every waiting run waits, and its restore replays only the operations since its last
automatic snapshot (a few optimizer steps, the trainer's snapshots.py).

The protocol, and the invariants that make a controller or trainer death at any point lose
nothing and apply nothing twice:

1. `page_begin` (Lua): READY -> PAGING, only while the run holds that slot, its head is not
   CLAIMED (nothing in flight) and, for an idle page-out, nothing is open. PAGING stops its
   claims and pushes (they need READY), so from here its trainer state is frozen at seq_id
   `head - 1`: every operation before the head is terminal, none at or after it was applied.
2. SaveState under a fresh id into `paged-<seq>-<nonce>` of the run's folder, then the replay
   log records it as the snapshot after `seq` (recovery.record_page), dropping the entries it
   covers. A snapshot recorded here is correct whatever happens next: it is the state after
   `seq`, and any operation applied later has a larger seq_id and is logged after it. Then
   the trainer deletes the run's snapshots and page-out saves the log no longer points to
   (recovery.prune, the trainer's PruneSnapshots): still PAGING, the run cannot record a
   newer one meanwhile. A death between recording and pruning leaves the superseded folders
   to the next page-out's prune or to the run's retirement (recovery.forget).
3. `page_end` (Lua): PAGING -> PAGED with `restore` set, the slot freed in the registry; if
   operations arrived meanwhile, it is queued for a slot at once.
4. The trainer's slot is unbound, and the freed slot filled (Placer.fill).

- The trainer keeps the run's state until the registry no longer gives it the slot (4 after
  3): a death before 3 leaves a READY-able run with its state intact on the trainer.
- A run is PAGED only with its state recoverable from the replay log: the snapshot of 2, or,
  for a forced page-out the trainer could not save, the last snapshot plus the logged
  operations since (the log holds every applied operation, recovery.py).
- Restoring starts from a fresh bind and loads the applied operation ids with the state, so
  an operation re-sent after a page-in is answered from the trainer's dedup, never re-applied.
- A page-out interrupted between 1 and 3 (SaveState failed, the controller died, a newer
  leader took over) leaves the run PAGING in the `paging` set; `page_abort` makes it READY
  again (the leader's sweep does it for every PAGING run no page-out of its own is driving),
  which is right because the trainer still holds its state. A trainer lost meanwhile makes it
  UNAVAILABLE (replica_lost.lua), and `page_end`/`page_abort` then change nothing.
- A stale slot left on the trainer by a death between 3 and 4 is cleared by the next bind of
  that slot (Placer._prepare_slot) or by the paged run's own restore.
- Every transition carries the leader epoch, so a deposed leader's page-out cannot finish.

Fairness: waiting runs are placed oldest waiting first (place.lua), and `max_slots_per_tenant`
caps the slots one tenant holds; a waiting run whose tenant is at the cap gets one of its own
tenant's idle slots paged out, never another tenant's. The page-out and page-in durations are
metrics (metrics.PAGE_*) and log lines (`paged out`, `paged in`), which bench/paging.py reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from lorafleet import errors
from lorafleet_controller import metrics
from lorafleet_controller.clients import Pool
from lorafleet_controller.recovery import Recovery
from lorafleet_controller.registry import TRAINER, Placer, Registry, RegRecord
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import RegState, named, text
from lorafleet_controller.store.paging import PageOutsRepo

log = logging.getLogger(__name__)

# How long a forced page-out waits for the run's operation in flight to finish.
FORCE_WAIT_SECONDS = 300.0
_FORCE_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class PageOut:
    """What `Pager.page_out` did: the run's state afterwards and how long it took."""

    state: RegState
    seconds: float = 0.0


class Pager:
    """Pages idle bound runs out when registrations wait, and forced page-outs."""

    def __init__(
        self,
        registry: Registry,
        pool: Pool,
        recovery: Recovery,
        placer: Placer,
        settings: ControllerSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.store = registry.store
        self.keys = registry.store.keys
        self.page_outs = PageOutsRepo(registry.store)
        self.pool = pool
        self.recovery = recovery
        self.placer = placer
        self.settings = settings
        self.clock = clock
        self._driving: set[str] = set()  # page-outs this controller is running now

    # --- one page-out ---------------------------------------------------------------------
    async def page_out(self, rid: str, *, idle: bool = False, replay: bool = False) -> PageOut:
        """Page a bound run out (see the module docstring). `idle`: the sweep's page-out,
        which changes nothing unless the run is idle and never waits or raises for a busy
        run. `replay`: page out a run with un-stepped gradients too (restored by replay)."""
        force = not idle
        trigger = "idle" if idle else "forced"
        rec = await self.registry.get_any(rid)
        if rec is None:
            raise errors.NotFound(f"no registration {rid!r}", field="registration_id")
        if rec.state != RegState.READY:
            return PageOut(rec.state)
        idle_before = 0.0 if force else self.clock() - self.settings.page_idle_seconds
        deadline = time.monotonic() + FORCE_WAIT_SECONDS
        while True:
            out = named(
                await self.store.scripts.run(
                    "page_begin",
                    [self.keys.reg(rid)],
                    rid,
                    rec.replica,
                    rec.slot,
                    idle_before,
                    epoch=self.store.epoch,
                    group=self.keys.group_of(rid),
                )
            )
            code = text(out["code"])
            if code == "ok":
                break
            if code == "moved" or not force:
                return PageOut(await self._state(rid))
            if time.monotonic() > deadline:
                raise errors.FailedPrecondition(
                    f"{rid} kept an operation in flight for {FORCE_WAIT_SECONDS:g}s",
                    field="registration_id",
                    reason="RUN_BUSY",
                )
            await asyncio.sleep(_FORCE_POLL_SECONDS)
        seq = int(out["seq"])
        self._driving.add(rid)
        start = time.perf_counter()
        try:
            if not await self._save(rec, seq, force, replay):
                await self._abort(rid)
                return PageOut(await self._state(rid))
            end = named(
                await self.store.scripts.run(
                    "page_end",
                    [self.keys.reg(rid)],
                    rid,
                    self.clock(),
                    epoch=self.store.epoch,
                    group=self.keys.group_of(rid),
                )
            )
        except BaseException:
            with contextlib.suppress(Exception):  # else the next sweep aborts it
                await self._abort(rid)
            raise
        finally:
            self._driving.discard(rid)
        if text(end["code"]) != "paged":
            return PageOut(await self._state(rid))
        await self.registry.paged_out(
            rid,
            text(end["replica"]),
            int(end["slot"]),
            text(end["base_model"]),
            int(end["waiting"]) == 1,
        )
        rep = await self.registry.replica(text(end["replica"]))
        if rep is not None and rep.healthy:
            await self.placer.unbind_quietly(rep.address, int(end["slot"]), rid)
        seconds = time.perf_counter() - start
        metrics.PAGE_OUTS.labels(trigger=trigger).inc()
        metrics.PAGE_OUT_SECONDS.observe(seconds)
        log.info(
            "paged out %s (%s) in %.3fs from %s slot %s",
            rid,
            trigger,
            seconds,
            text(end["replica"]),
            text(end["slot"]),
        )
        await self.placer.fill(text(end["base_model"]))
        return PageOut(RegState.PAGED, seconds)

    async def _save(self, rec: RegRecord, seq: int, force: bool, replay: bool) -> bool:
        """Save the slot into the checkpoint store and record it as the snapshot after `seq`.
        False when the page-out must be given up (the run stays bound)."""
        rid = rec.registration_id
        rep = await self.registry.replica(rec.replica)
        if rep is None or not rep.healthy:
            return False
        nonce = uuid.uuid4().hex[:12]
        trainer = self.pool.trainer(rep.address)
        try:
            manifest = await trainer.save_state(
                f"{rid}#page@{seq}:{nonce}",
                rec.slot,
                rid,
                f"paged-{seq}-{nonce}",
                True,
                incarnation=rep.incarnation,
            )
        except errors.LorafleetError as exc:
            if replay and exc.reason == "PENDING_GRADIENTS":
                return True  # restored by replay from the last snapshot (the log has the rest)
            log.warning("paging %s out: the trainer's save failed (%s); it stays bound", rid, exc)
            if force:
                raise
            return False
        await self.recovery.record_page(rid, seq, manifest)
        await self.recovery.prune(trainer, rid)
        return True

    async def _abort(self, rid: str) -> None:
        await self.store.scripts.run(
            "page_abort",
            [self.keys.reg(rid)],
            rid,
            self.clock(),
            epoch=self.store.epoch,
            group=self.keys.group_of(rid),
        )

    async def _state(self, rid: str) -> RegState:
        rec = await self.registry.get_any(rid)
        return rec.state if rec is not None else RegState.RETIRED

    # --- the leader's sweep ---------------------------------------------------------------
    async def sweep(self) -> None:
        """Abort page-outs nobody drives any more, then page idle runs out for waiting ones."""
        for rid in await self.page_outs.in_progress():
            if rid not in self._driving:
                log.warning("a page-out of %s was interrupted: it stays bound", rid)
                await self._abort(rid)
        if self.settings.page_idle_seconds <= 0:
            return
        for base in sorted({r.base_model for r in await self.registry.replicas(TRAINER)}):
            if not await self.registry.queued(base):
                continue
            # Free slots first (a page-in whose fill was lost with its controller, a run
            # under its cap again); then page idle runs out for the rest.
            await self.placer.fill(base)
            victims = await self._victims(base)
            if victims:
                await asyncio.gather(
                    *(self.page_out(rid, idle=True, replay=True) for rid in victims)
                )

    async def _victims(self, base_model: str) -> list[str]:
        """Idle bound runs to page out for the registrations waiting on `base_model`: one per
        waiter that a free slot does not serve, least recently active first; a waiter whose
        tenant is at its cap frees one of its own tenant's slots."""
        waiters = [
            r
            for r in await self.registry.get_many(await self.registry.queued(base_model))
            if r is not None and r.state in (RegState.QUEUED, RegState.UNAVAILABLE, RegState.PAGED)
        ]
        if not waiters:
            return []
        trainers = [r for r in await self.registry.replicas(TRAINER, base_model) if r.healthy]
        tables = await self.registry.slot_tables([r.replica_id for r in trainers])
        free = sum(max(0, r.num_slots - len(tables[r.replica_id])) for r in trainers)
        bound = [
            r
            for r in await self.registry.get_many(
                [rid for t in tables.values() for rid in t.values()]
            )
            if r is not None
        ]
        held: dict[str, int] = {}
        for r in bound:
            held[r.tenant] = held.get(r.tenant, 0) + 1
        cutoff = self.clock() - self.settings.page_idle_seconds
        idle = sorted(
            (
                r
                for r in bound
                if r.state == RegState.READY and r.pending == 0 and r.last_active < cutoff
            ),
            key=lambda r: r.last_active,
        )
        cap = self.settings.max_slots_per_tenant
        victims: list[str] = []
        for waiter in waiters:
            capped = cap > 0 and held.get(waiter.tenant, 0) >= cap
            if not capped and free > 0:
                free -= 1  # Placer.fill gives it a free slot
                continue
            pick = next((r for r in idle if not capped or r.tenant == waiter.tenant), None)
            if pick is None:
                continue
            idle.remove(pick)
            victims.append(pick.registration_id)
            held[pick.tenant] -= 1
            held[waiter.tenant] = held.get(waiter.tenant, 0) + 1
        return victims
