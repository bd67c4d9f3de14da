"""The one channel factory: shared message-size limits, keepalive, TLS, and safe retries.

Transport retries live in the channel's service config, and only for the methods a caller
names as idempotent (read-only RPCs, or RPCs keyed by an operation id that the server
deduplicates). Everything else is retried, if at all, by application code that knows the
operation's identity. Callers always pass `timeout=` as well: gRPC has no default deadline.

Keepalive is set here for both ends: clients ping every `KEEPALIVE_TIME_MS`, and servers
(`server_options`) accept pings twice as often, even between calls. A server that allows
fewer pings than its clients send answers GOAWAY "too_many_pings" and drops the connection.

A channel that reads server streams at a slow consumer's pace (the gateway passing a download
on to its HTTP client) pins its receive window (`stream_window_bytes`): by default gRPC grows a
stream's window to twice the bandwidth-delay product it measures, and on a loaded machine that
let one 1 GiB download sit 160 MB deep in the gateway.

With LORAFLEET_TLS_* set (`lorafleet.tls`), channels present the process's certificate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import grpc

from lorafleet.rpc.auth import channel_credentials, channel_options, identity_or_exit
from lorafleet.tls import TlsIdentity

KEEPALIVE_TIME_MS = 30_000
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


def keepalive_options() -> list[tuple[str, int]]:
    """Client side: ping idle connections so a dead peer is noticed within ~40 s."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(limit: int | None = None) -> list[tuple[str, int]]:
    """Server side: message limits, and permit the clients' keepalive pings (see above)."""
    return [
        *message_options(limit),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
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
    address: str,
    *,
    idempotent_methods: Sequence[str] = (),
    limit: int | None = None,
    tls: TlsIdentity | None = None,
    stream_window_bytes: int | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `address`: mutual TLS with `tls` or, by default, the identity in
    LORAFLEET_TLS_*; plaintext when neither is set (development). `stream_window_bytes`: a
    fixed per-stream receive window, the most a server stream buffers ahead of its reader."""
    tls = tls or identity_or_exit()
    window = (
        [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window_bytes)]
        if stream_window_bytes
        else []
    )
    options: list[tuple[str, int | str]] = [
        *window,
        *message_options(limit),
        *keepalive_options(),
        *channel_options(tls),
        ("grpc.enable_retries", 1 if idempotent_methods else 0),
        ("grpc.service_config", _service_config(idempotent_methods)),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


def make_blocking_channel(address: str, *, tls: TlsIdentity | None = None) -> grpc.Channel:
    """A synchronous channel for command-line tools (`lorafleet status`, `keys`, `up`); the
    same limits, keepalive and credentials as `make_channel`, no transport retries."""
    tls = tls or identity_or_exit()
    options = [*message_options(), *keepalive_options(), *channel_options(tls)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(tls), options=options)
