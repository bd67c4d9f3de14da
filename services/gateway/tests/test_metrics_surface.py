"""The public app serves no metrics, and no client can mint new label values.

In process (build_app, no fleet): neither case reaches the controller.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from lorafleet_gateway.app import build_app
from lorafleet_gateway.metrics import UNMATCHED, method_label
from lorafleet_gateway.settings import GatewaySettings


@pytest.fixture
def public() -> TestClient:
    """The public app without its lifespan: no controller channel is opened."""
    return TestClient(build_app(GatewaySettings(), b"k" * 32))


def _served(route: str, method: str, status: int) -> float:
    labels = {"route": route, "method": method, "status": str(status)}
    return REGISTRY.get_sample_value("lorafleet_http_requests_total", labels) or 0.0


def test_metrics_are_not_served_on_the_public_port(public: TestClient) -> None:
    reply = public.get("/metrics")
    assert reply.status_code == 404
    assert reply.json() == public.get("/no-such-route").json()


def test_a_made_up_method_is_counted_as_other(public: TestClient) -> None:
    before = _served(UNMATCHED, "OTHER", 404)
    assert public.request("FOO", "/made-up-path-0123").status_code == 404
    assert _served(UNMATCHED, "OTHER", 404) == before + 1
    assert _served(UNMATCHED, "FOO", 404) == 0.0


@pytest.mark.parametrize(
    ("method", "label"),
    [("GET", "GET"), ("OPTIONS", "OPTIONS"), ("get", "OTHER"), ("PROPFIND", "OTHER")],
)
def test_method_label(method: str, label: str) -> None:
    assert method_label(method) == label
