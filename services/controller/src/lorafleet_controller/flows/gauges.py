"""The ledger's and registry's gauges (metrics.py), set by every sweep."""

from __future__ import annotations

from lorafleet_controller import metrics
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.registry import TRAINER, Registry


async def update(ledger: Ledger, registry: Registry) -> None:
    for state, n in (await ledger.depth()).items():
        metrics.LEDGER_OPERATIONS.labels(state=state).set(n)
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
