"""Which bind failures fail a run at once: only the trainer refusing the run's LoRA config
(any trainer of the model would refuse it the same way); everything else is retried."""

from __future__ import annotations

from lorafleet import errors
from lorafleet_controller.registry import terminal


def test_only_a_refused_config_is_terminal() -> None:
    assert terminal(errors.InvalidArgument("no module", field="lora_config.target_modules"))
    assert terminal(errors.InvalidArgument("too big", field="lora_config.rank"))
    assert not terminal(errors.InvalidArgument("slot 7 is outside [0, 4)", field="slot"))
    assert not terminal(errors.Unavailable("trainer down"))
    assert not terminal(errors.FailedPrecondition("lease", reason="LEASE_MISMATCH"))
    assert not terminal(errors.ResourceExhausted("busy", field="lora_config"))
