"""Bad LoRA input never hangs, through the real SDK (0.24.1 and 0.38) on a real fleet.

An unknown target name is a 400 naming it and the valid names in under a second; a run the
trainer refuses to bind after it was admitted fails, with the trainer's error, together with
every call waiting on it (an SDK future, a managed job) in under a second; a job waiting on
it can be cancelled; another tenant's run trains on. See validation_script.py for the flow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

pytestmark = pytest.mark.slow

LIMIT_S = 1.0  # the bound: a refusal or a failure reaches the caller within a second


@pytest.fixture(scope="module", params=["0.24.1", "0.38.0"])
def fleet(
    request: pytest.FixtureRequest, make_fleet: Callable[..., AbstractContextManager[object]]
) -> Iterator[object]:
    """Two trainer slots, so a run can be admitted and wait for one; a fleet per SDK version,
    so one version's runs (which keep their slots until their session times out) never
    hold the slots the other's flow counts on. Idle runs are never paged out here: the
    flow needs its filler run to hold its slot until it unloads it."""
    never_page = {"controller": {"LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS": "0"}}
    with make_fleet(trainers=1, rollouts=0, slots=2, extra_env=never_page) as running:
        yield running


def test_bad_targets_fail_fast_and_never_hang(request, run_sdk, fleet, target) -> None:
    version = request.node.callspec.params["fleet"]
    other_key = fleet.create_api_key(f"other-{version}", "validation test")  # type: ignore[attr-defined]
    out = run_sdk(version, "validation_script.py", target, OTHER_API_KEY=other_key)

    assert out["unknown_s"] < LIMIT_S, out
    assert "400" in out["unknown"] or "BadRequest" in out["unknown"], out["unknown"]
    for text in ("'wq', 'wv'", "lorafleet.target_modules", "q_proj", "down_proj", "all-linear"):
        assert text in out["unknown"], (text, out["unknown"])

    job_unknown = out["job_unknown"]
    assert job_unknown["status"] == 400 and out["job_unknown_s"] < LIMIT_S, out
    assert job_unknown["field"] == "targets", job_unknown
    assert "'wq', 'wv'" in job_unknown["detail"] and "q_proj" in job_unknown["detail"], job_unknown

    refusal = "leave no module to adapt"
    assert refusal in out["future"] and "failed" in out["future"], out["future"]
    assert out["future_s"] < LIMIT_S, out
    job = out["job"]
    assert job["state"] == "failed" and refusal in job["error"]["message"], job
    assert out["job_s"] < LIMIT_S, out
    assert refusal in out["later"] and out["later_s"] < LIMIT_S, out

    assert out["cancelled"]["state"] == "cancelled", out["cancelled"]

    # The other tenant's run trained on: one more step on the same datum lowered its loss.
    assert out["other_after"] < out["other_before"], out
