"""The leader's periodic sweep: expiries, published versions nothing holds, removed
checkpoints' files, finished sessions' records, silent replicas and sessions, unfinished
bindings, paging, stranded runs, gauges and usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from lorafleet_controller.catalog import Catalog
from lorafleet_controller.flows import gauges
from lorafleet_controller.flows.replicas import Replicas
from lorafleet_controller.flows.sessions import Sessions
from lorafleet_controller.flows.stranding import Stranding
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.loops import raise_if_stopped
from lorafleet_controller.paging import Pager
from lorafleet_controller.reclaim import Reclaimer
from lorafleet_controller.registry import TRAINER, Placer, Registry
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import StaleEpoch
from lorafleet_controller.tenancy import Tenancy
from lorafleet_controller.usage import Usage
from lorafleet_controller.version_gc import VersionCollector

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self,
        settings: ControllerSettings,
        is_leader: Callable[[], bool],
        ledger: Ledger,
        catalog: Catalog,
        reclaimer: Reclaimer,
        versions: VersionCollector,
        registry: Registry,
        placer: Placer,
        pager: Pager,
        tenancy: Tenancy,
        usage: Usage,
        replicas: Replicas,
        stranding: Stranding,
        sessions: Sessions,
    ):
        self.settings = settings
        self.is_leader = is_leader
        self.ledger = ledger
        self.catalog = catalog
        self.reclaimer = reclaimer
        self.versions = versions
        self.registry = registry
        self.placer = placer
        self.pager = pager
        self.tenancy = tenancy
        self.usage = usage
        self.replicas = replicas
        self.stranding = stranding
        self.sessions = sessions
        # Heartbeats go through Redis: after Redis was out of reach (or this process was
        # starved) for longer than a heartbeat interval, replicas get a full heartbeat
        # timeout from then before their silence counts (an outage fails nothing by itself).
        self._swept_at = self._heard_since = time.monotonic()
        # Sessions heartbeat through the gateway and this controller: one that could not reach
        # us (we were down, deposed, starved or cut off from Redis) gets a full session
        # timeout from the moment dispatch resumed before its silence counts.
        self._sessions_heard_since = self._heard_since

    def dispatch_resumed(self) -> None:
        """This controller leads (again): sessions' silence counts from now."""
        self._sessions_heard_since = time.monotonic()

    async def run(self) -> None:
        while self.is_leader():
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except StaleEpoch as exc:  # deposed: a newer leader sweeps now
                log.warning("sweeper stops: %s", exc)
                return
            except Exception:
                log.exception("sweep failed")
            raise_if_stopped()
            await asyncio.sleep(self.settings.sweep_interval_seconds)

    async def sweep_once(self) -> None:
        await self.ledger.sweep()
        await self.catalog.sweep_expired()
        await self.versions.collect_due()
        await self.reclaimer.reclaim_due()
        if self.settings.finished_session_retention_seconds:
            await self.tenancy.expire_finished(self.settings.finished_session_retention_seconds)
        if self.settings.retired_run_retention_seconds:
            await self.registry.expire_retired(self.settings.retired_run_retention_seconds)
        now = time.monotonic()
        if now - self._swept_at > self.settings.heartbeat_interval_seconds:
            self._heard_since = self._sessions_heard_since = now
            # An id popped from a ready list around the outage can be lost with its reply
            # (seen in the chaos test: the head stayed QUEUED, marked pushed, in no list).
            # Queue every head again; a duplicate id is harmless, the claim takes it once.
            for rid in await self.registry.all_ids():
                await self.ledger.repush(rid)
            await self.registry.sweep_reservations()
            await self.registry.repair_placements()
        silence = self.settings.heartbeat_timeout_seconds
        if now - self._heard_since < silence:
            silence = float("inf")
        for rep in await self.registry.silent_replicas(silence):
            await self.replicas.lose(
                rep.replica_id,
                f"{rep.kind} replica {rep.replica_id} missed heartbeats for "
                f"{self.settings.heartbeat_timeout_seconds:g}s",
            )
        await self.replicas.finish_losses()
        for rid in await self.registry.binding_ids():
            await self.placer.finish_binding(rid)
        await self.pager.sweep()
        for base in sorted(
            {r.base_model for r in await self.registry.replicas(TRAINER) if r.failed}
        ):
            await self.stranding.strand(
                base
            )  # a run that started waiting since (a paged run's call)
        timeout = self.settings.session_timeout_seconds
        if timeout and now - self._sessions_heard_since >= timeout:
            for tenant, session_id in await self.tenancy.silent_sessions(timeout):
                log.info("session %s missed heartbeats for %gs: finishing it", session_id, timeout)
                await self.sessions.finish(tenant, session_id, "heartbeat timeout")
        await gauges.update(self.ledger, self.registry, self.settings)
        await self.usage.tick()
        self._swept_at = time.monotonic()
