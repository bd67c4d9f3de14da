"""A failed operation blames the replica that failed: a rollout refusing a publish is not
reported as an unreachable trainer."""

from __future__ import annotations

from lorafleet import errors
from lorafleet_controller.scheduler import _server_failure


def test_a_refused_publish_names_the_rollout_not_the_trainer() -> None:
    refused = errors.Unavailable(
        "rollout replicas did not acknowledge r@1: rollout-0 (connection refused)",
        reason="PUBLISH_INCOMPLETE",
    )
    assert _server_failure(refused, "trainer-0") is refused


def test_an_unreachable_trainer_is_named() -> None:
    lost = _server_failure(errors.Unavailable("connection refused"), "trainer-0")
    assert lost.message == "trainer replica trainer-0 could not be reached: connection refused"
    assert lost.reason == "TRAINER_UNREACHABLE"
