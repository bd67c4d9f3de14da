"""The controller: wires the Redis-backed parts and the flows over them (`flows/`) together,
and runs the background loops.

Holds no state that matters only in memory: the ledger, registry, catalog, samplers and
tenancy live in Redis; what is in memory (the long-poll waiters, per-trainer batch queues,
sampler load counters) is rebuilt or re-derived by `start()` after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lorafleet_controller.catalog import Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.discovery.types import Discovery
from lorafleet_controller.fleet import Fleet
from lorafleet_controller.flows import runs
from lorafleet_controller.flows.operations import Operations
from lorafleet_controller.flows.registrations import Registrations
from lorafleet_controller.flows.replicas import Replicas
from lorafleet_controller.flows.runs import Runs
from lorafleet_controller.flows.sampling import Sampling
from lorafleet_controller.flows.sessions import Sessions
from lorafleet_controller.flows.stranding import Stranding
from lorafleet_controller.flows.sweeper import Sweeper
from lorafleet_controller.jobs.runner import JobRunner
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.membership import Membership
from lorafleet_controller.notify import Notifier
from lorafleet_controller.paging import Pager
from lorafleet_controller.publish import Publisher
from lorafleet_controller.reclaim import Reclaimer
from lorafleet_controller.recovery import Recovery
from lorafleet_controller.registry import TRAINER, Placer, Registry
from lorafleet_controller.samplers import Samplers
from lorafleet_controller.scheduler import Scheduler
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.storage_quota import StorageQuota
from lorafleet_controller.store import Store, connect
from lorafleet_controller.tenancy import Tenancy
from lorafleet_controller.usage import Usage
from lorafleet_controller.version_gc import VersionCollector

log = logging.getLogger(__name__)


class Controller:
    """The controller's parts, the flows they are handed to, and the loops.

    `start()` makes it answer RPCs; `start_leading()` starts dispatch (scheduler, sweeper,
    discovery). Without leader election both happen at start; with it, the elector calls
    `start_leading` / `stop_leading`, and `is_leader` (the elector's clock-based check) is
    asked again before every claim, dispatch and sweep, so a controller whose lease ran out
    stops writing even before its loops are cancelled.
    """

    def __init__(
        self,
        settings: ControllerSettings,
        clock: Callable[[], float] = time.time,
        discovery: Discovery | None = None,
        is_leader: Callable[[], bool] = lambda: True,
    ):
        self.settings = settings
        self.is_leader = is_leader  # the elector's clock-based check, when electing
        self.store = Store(
            connect(settings.redis_url, cluster=settings.redis_cluster),
            settings.key_prefix,
            settings.ledger_groups,
            full_fraction=settings.store_full_fraction,
            room_check_seconds=settings.store_room_check_seconds,
        )
        # BLPOP holds a connection: the scheduler's intake gets a client of its own.
        self.blocking = connect(settings.redis_url, cluster=settings.redis_cluster)
        self.notifier = Notifier(self.store)
        self.pool = Pool(settings.transport_retry_seconds, settings.rpc_timeout_seconds)
        self.ledger = Ledger(self.store, settings, self.notifier, clock)
        self.registry = Registry(self.store, settings, clock)
        self.catalog = Catalog(self.store, clock)
        self.tenancy = Tenancy(self.store, clock)
        self.usage = Usage(self.store, self.registry)  # per-tenant usage (chargeback)
        # Recovery and the placer end runs through the run flows, which use them: the
        # callbacks look `self.runs` up when called.
        self.recovery = Recovery(
            self.store,
            self.catalog.manifest_for,
            lambda rid, error: self.runs.retire_corrupted(rid, error),
            functools.partial(runs.trainer_of, self.registry, self.pool),
        )
        self.placer = Placer(
            self.registry,
            self.pool,
            lambda trainer, rec, rep: self.recovery.restore(
                trainer, rec, rep.replica_id, rep.incarnation
            ),
            lambda rid, error: self.runs.fail(rid, error),
        )
        self.runs = Runs(self.registry, self.ledger, self.placer, self.recovery)
        self.pager = Pager(self.registry, self.pool, self.recovery, self.placer, settings, clock)
        self.samplers = Samplers(self.store, self.ledger, self.registry, self.pool, settings)
        self.publisher = Publisher(
            self.store,
            settings.storage_root,
            self.registry,
            self.catalog,
            self.samplers,
            self.pool,
            settings.resident_versions,
            settings.shared_adapter_root,
            rollout_wait_seconds=settings.rollout_wait_seconds,
            clock=clock,
        )
        self.scheduler = Scheduler(
            self.blocking,
            self.store.keys,
            self.ledger,
            self.registry,
            self.catalog,
            self.pool,
            settings,
            self.publisher.publish,
            self.recovery,
            gate=is_leader,
        )
        self.fleet = Fleet(self.registry, self.ledger, self.pool)
        # --- flows ---
        self.sessions = Sessions(self.tenancy, self.registry, self.runs)
        self.registrations = Registrations(
            self.tenancy,
            self.catalog,
            self.registry,
            self.ledger,
            self.placer,
            self.runs,
            self.publisher,
        )
        self.operations = Operations(
            self.ledger,
            self.placer,
            self._background,
            StorageQuota(self.store, settings.max_stored_bytes_per_tenant),
        )
        self.sampling = Sampling(
            self.tenancy, self.registry, self.catalog, self.samplers, self.publisher
        )
        self.stranding = Stranding(self.registry, self.ledger)
        self.replicas = Replicas(
            self.registry,
            self.pool,
            self.placer,
            self.publisher,
            self.stranding,
            self._background,
        )
        self.sweeper = Sweeper(
            settings,
            is_leader,
            self.ledger,
            self.catalog,
            Reclaimer(self.store, settings.checkpoint_reclaim_grace_seconds, clock),
            VersionCollector(
                self.store,
                self.registry,
                self.pool,
                settings.checkpoint_reclaim_grace_seconds,
                clock,
            ),
            self.registry,
            self.placer,
            self.pager,
            self.tenancy,
            self.usage,
            self.replicas,
            self.stranding,
            self.sessions,
        )
        self.membership: Membership | None = None
        if discovery is not None:
            self.membership = Membership(
                discovery,
                self.registry,
                self.pool,
                self.replicas.admit,
                self.replicas.lose,
                probe_interval=settings.heartbeat_interval_seconds,
            )
        self.jobs = JobRunner(self)  # managed training jobs (issue 13); run by the leader
        self._loops: list[asyncio.Task[None]] = []
        self._side: set[asyncio.Task[None]] = set()
        self._leading = asyncio.Lock()
        self._room: asyncio.Task[None] | None = None  # Redis's memory, read (store/room.py)

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, lead: bool = True) -> None:
        await self.store.ping()
        await self.store.check_layout()
        room = await self.store.room.verify()
        self._room = asyncio.create_task(self.store.room.run(), name="store-room")
        if not room.limit:
            log.warning(
                "Redis has no maxmemory: at the machine's limit it fails writes, or is killed, "
                "instead of the fleet refusing new work first; set maxmemory (noeviction)"
            )
        await self.notifier.start()
        if lead:
            await self.start_leading()

    async def start_leading(self) -> None:
        """Recover what a previous leader left (claims, ready heads) and start dispatching."""
        async with self._leading:
            if self._loops:
                return
            epoch = await self.store.take_epoch()
            self.sweeper.dispatch_resumed()
            log.info("dispatching under leader epoch %d", epoch)
            await self.scheduler.recover()
            await self.samplers.recover()
            self._loops = [
                asyncio.create_task(self.scheduler.run(), name="scheduler"),
                asyncio.create_task(self.sweeper.run(), name="sweeper"),
            ]
            if self.membership is not None:
                self._loops.append(asyncio.create_task(self.membership.run(), name="membership"))
        self._background(self._fill_all())
        await self.jobs.resume()

    async def _fill_all(self) -> None:
        """Place what queued up while no leader acted on it (e.g. a trainer came back)."""
        for base in sorted({r.base_model for r in await self.registry.replicas(TRAINER)}):
            await self.placer.fill(base)

    async def stop_leading(self) -> None:
        """Stop every loop and in-flight dispatch; CLAIMED operations stay for the next leader.

        The next leader re-sends them under the same operation id, and the trainer answers a
        repeated id with its first result, so nothing runs twice.
        """
        async with self._leading:
            await self.jobs.stop()  # jobs resume from their cursors under the next leader
            tasks = [*self._loops, *self._side]
            self._loops = []
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.scheduler.stop()
            await self.samplers.stop()
            self.store.drop_epoch()
            self.usage.forget_tick()

    async def stop(self) -> None:
        await self.stop_leading()
        if self._room is not None:
            self._room.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._room
        await self.notifier.stop()
        await self.pool.close()
        await self.blocking.aclose()
        await self.store.close()

    @property
    def leading(self) -> bool:
        """Dispatch loops are running and the lease (if any) is still held."""
        return bool(self._loops) and self.is_leader()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        if not self.leading:  # a standby changes no placements; the leader re-derives them
            coro.close()
            return
        task = asyncio.create_task(coro)
        self._side.add(task)
        task.add_done_callback(self._side.discard)
