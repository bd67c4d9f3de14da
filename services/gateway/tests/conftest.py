"""Gateway test fixtures: a whole fleet per module, its gateway with short long-polls.

`sdk_python` and `make_fleet` come from the root conftest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    """Redis, controller, one trainer, one rollout and this gateway, as real processes."""
    gateway_env = {
        "LORAFLEET_GATEWAY_LONG_POLL_SECONDS": "2",
        "LORAFLEET_GATEWAY_MAX_BODY_BYTES": str(1 << 20),
        "LORAFLEET_GATEWAY_MAX_SMALL_BODY_BYTES": str(64 << 10),
    }
    # Paging off: test_queue_state_of_an_operation_waiting_for_a_slot needs a run that stays
    # queued while the slots' holders sit idle (paging is tested in tests/e2e/test_paging_sdk.py).
    # A short grace, so test_gateway_fleet sees a delivered result released (410).
    controller_env = {
        "LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS": "0",
        "LORAFLEET_CONTROLLER_ACKED_RESULT_GRACE_SECONDS": "2",
    }
    extra_env = {"gateway": gateway_env, "controller": controller_env}
    with make_fleet(trainers=1, rollouts=1, slots=4, extra_env=extra_env) as running:
        yield running
