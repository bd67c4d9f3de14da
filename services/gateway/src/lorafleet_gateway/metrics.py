"""The gateway's Prometheus metrics (default registry), served only on the operators'
metrics port (LORAFLEET_GATEWAY_METRICS_PORT), never on the public HTTP port.

Every label value is bounded, whatever a client sends: the route label is the route
*template* ("/api/v1/samplers/{sampling_session_id}"), never the raw path, so ids cannot blow
up the label cardinality, and unmatched paths share one label; the method label is one of
the standard methods or OTHER (method_label); the status is the one the gateway answered.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

UNMATCHED = "unmatched"
OTHER_METHOD = "OTHER"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

HTTP_REQUESTS = Counter(
    "lorafleet_http_requests_total",
    "HTTP requests served by the gateway.",
    ["route", "method", "status"],
)
HTTP_SECONDS = Histogram(
    "lorafleet_http_request_seconds",
    "Time to answer an HTTP request (long polls included).",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 45),
)


def method_label(method: str) -> str:
    """The request's method as a label value: a client may send any token as its method, and
    each distinct one would be a new time series, so anything non-standard is OTHER."""
    return method if method in KNOWN_METHODS else OTHER_METHOD
