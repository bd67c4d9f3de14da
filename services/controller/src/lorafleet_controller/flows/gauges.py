"""The ledger's, admission's and registry's gauges (metrics.py), set by every sweep."""

from __future__ import annotations

from lorafleet_controller import metrics
from lorafleet_controller.ledger import Ledger, admission_limits
from lorafleet_controller.registry import TRAINER, Registry
from lorafleet_controller.settings import ControllerSettings


async def update(ledger: Ledger, registry: Registry, settings: ControllerSettings) -> None:
    for state, n in (await ledger.depth()).items():
        metrics.LEDGER_OPERATIONS.labels(state=state).set(n)
    limits = admission_limits(settings)
    limit = {
        "pending": limits.pending_global,
        "unacked": limits.unacked_global,
        "pending_bytes": limits.pending_bytes_global,
        "unacked_bytes": limits.unacked_bytes_global,
    }
    for kind, n in (await ledger.fleet_load()).items():
        metrics.ADMISSION_LOAD.labels(kind=kind).set(n)
        metrics.ADMISSION_LIMIT.labels(kind=kind).set(limit[kind])
    metrics.GAP_STALLS.set(await ledger.gap_stalls())
    queued = 0
    trainers = await registry.replicas(TRAINER)
    tables = await registry.slot_tables([rep.replica_id for rep in trainers])
    for rep in trainers:
        used = len(tables[rep.replica_id])
        metrics.REGISTRY_SLOTS.labels(replica=rep.replica_id, state="bound").set(used)
        metrics.REGISTRY_SLOTS.labels(replica=rep.replica_id, state="free").set(
            max(0, rep.num_slots - used)
        )
        queued += len(await registry.queued(rep.base_model))
    metrics.REGISTRY_QUEUED.set(queued)
