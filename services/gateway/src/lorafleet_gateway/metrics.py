"""The gateway's Prometheus metrics (default registry, served at /metrics on the HTTP port).

The route label is the route *template* ("/api/v1/samplers/{sampling_session_id}"), never
the raw path, so ids cannot blow up the label cardinality; unmatched paths share one label.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

UNMATCHED = "unmatched"

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
