"""Runs waiting for a trainer of a base model whose every trainer is down, one for good."""

from __future__ import annotations

import logging

from lorafleet import errors
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.registry import TRAINER, Registry, Replica
from lorafleet_controller.store import RegState

log = logging.getLogger(__name__)


def no_healthy_trainer(now: float, base_model: str, trainers: list[Replica]) -> errors.Unavailable:
    """The error naming each trainer of `base_model` and why it is down (at clock `now`)."""
    why = {
        t.replica_id: f"failed: {t.failed}"
        if t.failed
        else f"last seen {now - t.last_seen:.0f}s ago"
        for t in trainers
    }
    down = ", ".join(f"{replica} ({text})" for replica, text in why.items())
    return errors.Unavailable(
        f"no healthy trainer serves base model {base_model!r}: {down} is down; "
        "retry once it is back (`lorafleet status` says why it is down)",
        field="base_model",
        reason="NO_HEALTHY_TRAINER",
    )


class Stranding:
    def __init__(self, registry: Registry, ledger: Ledger):
        self.registry = registry
        self.ledger = ledger

    async def strand(self, base_model: str) -> list[str]:
        """Fail the open operations of every run waiting for a trainer of `base_model` when
        none is healthy and one is known to have failed for good, with an Unavailable that
        names it, so waiting callers hear it now instead of polling a queue that will not move.
        The sweep calls it again while that lasts: a paged run's next call queues it for a
        slot after the failure, and it must not wait either.

        The runs stay (UNAVAILABLE, with the same reason: later calls are refused with it) and
        are placed, or rebuilt by replay, if a trainer of the model registers again. A trainer
        that is merely lost (restarting, a pod being rescheduled) strands nothing: its runs
        wait for it and are rebuilt exactly, as recovery.py promises.
        """
        trainers = await self.registry.replicas(TRAINER, base_model)
        if any(t.healthy for t in trainers) or not any(t.failed for t in trainers):
            return []
        error = no_healthy_trainer(self.registry.clock(), base_model, trainers)
        waiting = await self.registry.get_many(await self.registry.queued(base_model))
        stranded = [  # the sweep repeats this: a run already told, with nothing open, is done
            r.registration_id
            for r in waiting
            if r is not None
            and (
                r.state != RegState.UNAVAILABLE
                or r.pending
                or r.unavailable_reason != error.message
            )
        ]
        for rid in stranded:
            await self.ledger.fence(rid, RegState.UNAVAILABLE, error, error.message)
        if stranded:
            log.warning("%s: %d waiting runs fail their open operations", error, len(stranded))
        return stranded
