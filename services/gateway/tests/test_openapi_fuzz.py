"""Schemathesis fuzzes every operation of the gateway's OpenAPI document against a real fleet.

The only property checked is the one the gateway promises for any input: no 5xx. Valid and
invalid bodies, odd path parameters and protobuf garbage all must end as 2xx or 4xx.
Schemathesis' own pytest plugin does not support pytest 9 yet, so each operation's
Hypothesis strategy is driven directly with @given.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

# forward_backward also takes tinker_public protobuf bodies: fuzz them as arbitrary bytes.
schemathesis.openapi.media_type("application/x-protobuf", st.binary(max_size=512))
EXAMPLES = 12
# CI replays the same examples every run (a red CI must be reproducible); locally each run
# explores new ones.
DERANDOMIZE = bool(os.environ.get("CI"))


@pytest.mark.slow
def test_no_server_errors(fleet: object) -> None:
    base_url: str = fleet.base_url  # type: ignore[attr-defined]
    headers = {"X-API-Key": fleet.api_key}  # type: ignore[attr-defined]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 30
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=DERANDOMIZE,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=base_url, headers=headers, checks=[not_a_server_error])

        fuzz()
    # The fuzzing really reached the gateway: count what it served, by status class.
    metrics_port = fleet.member("gateway").metrics_port  # type: ignore[attr-defined]
    served = _served(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)
    assert served.get("5", 0) == 0 and sum(served.values()) > 10 * len(operations), served


def _served(metrics: str) -> dict[str, float]:
    by_class: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("lorafleet_http_requests_total{"):
            status = line.split('status="', 1)[1][0]
            by_class[status] = by_class.get(status, 0) + float(line.rsplit(" ", 1)[1])
    return by_class
