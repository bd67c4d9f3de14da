"""When a job stops, decided once per full pass (juno §11.5).

The loss compared with `loss_target` is the validation loss when a validation split is
held out, otherwise the pass's token-weighted training loss. In order:

1. `target_reached`: that loss is at or below `loss_target` (0 turns the target off);
2. `low_loss_guard`: the training loss fell to `early_stop` or below (memorising, 0 = off);
3. `patience`: the validation loss has not improved by more than `min_delta` for
   `validation_patience` passes;
4. `max_iters`: `max_iters` passes are done.

The best validation loss is tracked here; the loop snapshots the adapter whenever
`improved` says so and restores the best snapshot when the job stops.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lorafleet_controller.jobs.params import JobParams

TARGET = "target_reached"
LOW_LOSS = "low_loss_guard"
PATIENCE = "patience"
MAX_ITERS = "max_iters"


@dataclass
class Stopper:
    """Early-stopping state; plain data so a job's cursor can store it."""

    best: float | None = None
    best_pass: int = 0
    bad_passes: int = 0

    def observe(self, pass_number: int, validation_loss: float, min_delta: float) -> bool:
        """Record a pass's validation loss; True when it is the best so far."""
        if self.best is None or validation_loss < self.best - min_delta:
            self.best, self.best_pass, self.bad_passes = validation_loss, pass_number, 0
            return True
        self.bad_passes += 1
        return False

    def decide(
        self, p: JobParams, passes: int, train_loss: float, validation_loss: float | None
    ) -> str:
        """The stop reason after `passes` passes, or '' to go on."""
        watched = train_loss if validation_loss is None else validation_loss
        if p.loss_target > 0 and watched <= p.loss_target:
            return TARGET
        if p.early_stop > 0 and train_loss <= p.early_stop:
            return LOW_LOSS
        if validation_loss is not None and self.bad_passes >= p.validation_patience:
            return PATIENCE
        if passes >= p.max_iters:
            return MAX_ITERS
        return ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
