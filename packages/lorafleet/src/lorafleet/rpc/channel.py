"""The one channel factory: shared message-size limits, keepalive, and safe retries.

Transport retries live in the channel's service config, and only for the methods a caller
names as idempotent (read-only RPCs, or RPCs keyed by an operation id that the server
deduplicates). Everything else is retried, if at all, by application code that knows the
operation's identity. Callers always pass `timeout=` as well: gRPC has no default deadline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def max_message_bytes() -> int:
    """The limit servers and channels share (LORAFLEET_MAX_MESSAGE_BYTES overrides it)."""
    return int(os.environ.get("LORAFLEET_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES))


def message_options(limit: int | None = None) -> list[tuple[str, int]]:
    limit = limit or max_message_bytes()
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]


def _service_config(idempotent_methods: Sequence[str]) -> str:
    names = []
    for full in idempotent_methods:
        service, _, method = full.strip("/").partition("/")
        names.append({"service": service, "method": method})
    config = {
        "methodConfig": [
            {
                "name": names,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
        if names
        else []
    }
    return json.dumps(config)


def make_channel(
    address: str, *, idempotent_methods: Sequence[str] = (), limit: int | None = None
) -> grpc.aio.Channel:
    """An insecure aio channel to `address` (in-cluster traffic; TLS terminates at ingress)."""
    options: list[tuple[str, int | str]] = [
        *message_options(limit),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1 if idempotent_methods else 0),
        ("grpc.service_config", _service_config(idempotent_methods)),
    ]
    return grpc.aio.insecure_channel(address, options=options)
