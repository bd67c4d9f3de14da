"""How a training run ends: retired by its owner, failed by its trainer, or found corrupted.

Every end fences the run's queue (its open operations fail with the error), frees its slot and
drops its recovery state.
"""

from __future__ import annotations

from lorafleet import errors
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.recovery import Recovery
from lorafleet_controller.registry import TRAINER, Placer, Registry
from lorafleet_controller.store import RegState


class Runs:
    def __init__(self, registry: Registry, ledger: Ledger, placer: Placer, recovery: Recovery):
        self.registry = registry
        self.ledger = ledger
        self.placer = placer
        self.recovery = recovery

    async def retire(self, rid: str, error: errors.LorafleetError, reason: str = "") -> None:
        """Fail what the run has open with `error`, free its slot, forget its recovery state."""
        await self.ledger.fence(rid, RegState.RETIRED, error, reason)
        await self.placer.retire(rid)
        await self.recovery.forget(rid)

    async def retire_corrupted(self, rid: str, error: errors.LorafleetError) -> None:
        """A run that cannot be rebuilt: fail what it has open, free its slot."""
        await self.retire(rid, error, error.message)

    async def fail(self, rid: str, error: errors.LorafleetError) -> None:
        """A run its trainer refused to bind: it fails with that error (stored first, so a
        submit racing the fence already sees it), its open operations fail, its slot frees."""
        failed = await self.registry.record_failure(rid, error)
        err = failed.failure() if failed is not None else None
        if err is None:
            return
        await self.retire(rid, err, err.message)


async def trainer_of(registry: Registry, pool: Pool, rid: str) -> TrainerClient | None:
    """A healthy trainer of the run's base model (the one it was on first), whose storage
    root holds the run's folder; None when there is none now."""
    rec = await registry.get_any(rid)
    if rec is None:
        return None
    reps = [r for r in await registry.replicas(TRAINER, rec.base_model) if r.healthy]
    reps.sort(key=lambda r: r.replica_id != rec.replica)
    return pool.trainer(reps[0].address) if reps else None
