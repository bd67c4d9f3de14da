"""A fixed replica list, for running outside Kubernetes (tests, `lorafleet up`, bare VMs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from lorafleet.errors import InvalidArgument
from lorafleet_controller.discovery.types import KINDS, Endpoint


def parse_static(kind: str, entries: Iterable[str], *, field: str) -> list[Endpoint]:
    """Parse the controller's `id=host:port` setting entries into ready endpoints."""
    if kind not in KINDS:
        raise InvalidArgument(f"unknown replica kind {kind!r}", field=field)
    endpoints, seen = [], set()
    for i, entry in enumerate(entries):
        replica_id, sep, address = entry.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not replica_id or not colon or not host or not port.isdigit():
            raise InvalidArgument(f"expected 'id=host:port', got {entry!r}", field=f"{field}[{i}]")
        if not 0 < int(port) < 65536:
            raise InvalidArgument(f"port out of range in {entry!r}", field=f"{field}[{i}]")
        if replica_id in seen:
            raise InvalidArgument(f"duplicate replica id {replica_id!r}", field=f"{field}[{i}]")
        seen.add(replica_id)
        endpoints.append(Endpoint(kind, replica_id, address, ready=True))
    return endpoints


class StaticDiscovery:
    """Always the same endpoints; `watch()` yields them once and then waits for cancellation."""

    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self._endpoints = sorted(endpoints)

    async def snapshot(self) -> list[Endpoint]:
        return list(self._endpoints)

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        yield list(self._endpoints)
        await asyncio.Event().wait()  # nothing ever changes
