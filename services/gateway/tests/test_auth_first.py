"""Authenticate before reading (issue 36): an anonymous request costs the gateway bounded
memory, whatever body it sends.

A gateway of its own, with the default 64 MiB data-route limit, in front of a controller
(no trainers or rollouts: nothing here gets past the API key). The measure is the gateway
process's peak RSS: /proc/<pid>/clear_refs resets the high-water mark to the current RSS,
so VmHWM after the requests is the peak they caused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from lorafleet.testing import peak_rss, reset_peak_rss

MIB = 1 << 20
DATA_LIMIT = 64 * MIB  # GatewaySettings.max_body_bytes' default, which this gateway keeps


@pytest.fixture(scope="module")
def gateway(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    with make_fleet(trainers=0, rollouts=0) as fleet:
        yield fleet


def _huge_json(size: int) -> bytes:
    """A JSON body of exactly `size` bytes that parses into a large object tree."""
    head, tail = b'{"model_id":"m","seq_id":1,"data":[', b"]}"
    count = (size - len(head) - len(tail) + 1) // 2
    body = head + b",".join([b"0"] * count) + tail
    return body + b" " * (size - len(body))


def test_anonymous_64_mib_requests_leave_memory_within_64_mib_of_idle(gateway: object) -> None:
    base, key = gateway.base_url, gateway.api_key  # type: ignore[attr-defined]
    pid = gateway.member("gateway").proc.pid  # type: ignore[attr-defined]
    body = _huge_json(DATA_LIMIT)
    assert len(body) == DATA_LIMIT
    json_headers = {"Content-Type": "application/json"}
    anonymous = [
        ("/api/v1/forward_backward", {}),
        ("/api/v1/forward_backward", {"X-API-Key": "not-a-key"}),
        ("/api/v1/asample", {}),
        ("/api/v1/asample", {"X-API-Key": "not-a-key"}),
        ("/v1/lora/train-qa", {"X-API-Key": "not-a-key"}),
    ]
    with httpx.Client(base_url=base, timeout=120) as http:
        # warm every path the measured requests take, with small bodies
        for path, headers in anonymous:
            warm = http.post(path, content=b"{}", headers={**json_headers, **headers})
            assert warm.status_code == 401, warm.text
        known = http.post("/api/v1/telemetry", json={}, headers={"X-API-Key": key})
        assert known.status_code == 200, known.text
        idle = reset_peak_rss(pid)
        replies = [
            http.post(path, content=body, headers={**json_headers, **headers})
            for path, headers in anonymous
        ]
        peak = peak_rss(pid)
    assert peak - idle < 64 * MIB, f"peak {peak >> 10} KiB vs idle {idle >> 10} KiB"
    for (path, _), reply in zip(anonymous, replies, strict=True):
        assert (reply.status_code, reply.json()["field"]) == (401, "X-API-Key"), (path, reply.text)


def test_anonymous_refusals_keep_their_shape_and_open_routes_stay_open(gateway: object) -> None:
    base = gateway.base_url  # type: ignore[attr-defined]
    with httpx.Client(base_url=base, timeout=60) as http:
        missing = http.post("/api/v1/create_session", json={"tags": []})
        wrong = http.get("/api/v1/sessions", headers={"X-API-Key": "not-a-key"})
        for reply, detail in ((missing, "missing API key"), (wrong, "invalid API key")):
            assert reply.status_code == 401, reply.text
            assert reply.json() == {
                "detail": f"X-API-Key: {detail}",
                "field": "X-API-Key",
                "reason": "PermissionDenied",
                "category": "user",
            }
        # no key needed: bootstrap, health and the API document
        assert http.get("/api/v1/healthz").status_code == 200
        assert http.post("/api/v1/client/config", json={}).status_code == 200
        assert http.post("/api/v1/client/dynamic_config").status_code == 200
        assert http.get("/openapi.json").status_code == 200
        # a route that does not exist is still a 404, not a 401
        assert http.post("/api/v1/no_such_route", content=b"{}").status_code == 404
        assert json.loads(http.get("/api/v1/no_such_route").text)["detail"]
