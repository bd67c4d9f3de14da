"""Replica discovery from the EndpointSlices of the chart's headless Services.

The trainer and rollout StatefulSets each have a headless Service; Kubernetes keeps
EndpointSlices for them (label `kubernetes.io/service-name`) with one endpoint per pod, its IP,
readiness and owning pod. One list plus one watch with a set-based selector covers both kinds.
The `kubernetes` client is synchronous, so its calls run in worker threads; the watch pumps
events into the event loop through a queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from lorafleet_controller.discovery.types import KINDS, Endpoint

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
_END = object()


def endpoints_from_slice(
    raw: Mapping[str, Any], services: Mapping[str, str], port_name: str
) -> list[Endpoint]:
    """The endpoints of one EndpointSlice (as API JSON): pod name, IP:port, readiness.

    Readiness follows the API's rules: `ready` unset means ready, and a terminating pod
    is never ready, whatever `ready` says.
    """
    kind = services.get((raw.get("metadata", {}).get("labels") or {}).get(SERVICE_LABEL, ""))
    port = next((p.get("port") for p in raw.get("ports") or [] if p.get("name") == port_name), None)
    if kind is None or port is None:
        return []
    out = []
    for ep in raw.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        target = ep.get("targetRef") or {}
        replica_id = target.get("name") or ep.get("hostname")
        if not addresses or not replica_id:
            continue
        host = addresses[0]
        host = f"[{host}]" if ":" in host else host
        conditions = ep.get("conditions") or {}
        ready = conditions.get("ready") is not False and not conditions.get("terminating")
        out.append(Endpoint(kind, replica_id, f"{host}:{port}", ready))
    return out


def merge(slices: Mapping[str, list[Endpoint]]) -> list[Endpoint]:
    """One entry per (kind, pod): a pod listed in two slices mid-update counts once, ready wins."""
    best: dict[tuple[str, str], Endpoint] = {}
    for endpoints in slices.values():
        for ep in endpoints:
            key = (ep.kind, ep.replica_id)
            if key not in best or (ep.ready and not best[key].ready):
                best[key] = ep
    return sorted(best.values())


def _name(item: client.V1EndpointSlice) -> str:
    """A listed slice's name; the API server names every stored object, so none is a bug."""
    name = item.metadata.name if item.metadata is not None else None
    if not name:
        raise ValueError("the API server listed an EndpointSlice without metadata.name")
    return name


class KubernetesDiscovery:
    """Discovery through `DiscoveryV1Api` EndpointSlices in one namespace.

    `services` maps a headless Service name to the replica kind behind it, e.g.
    {"rel-lorafleet-trainer-headless": "trainer", "rel-lorafleet-rollout-headless": "rollout"}.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        services: Mapping[str, str],
        *,
        port_name: str = "grpc",
        watch_timeout_seconds: int = 300,
    ) -> None:
        bad = {kind for kind in services.values() if kind not in KINDS}
        if bad or not services:
            raise ValueError(f"services must map Service names to {KINDS}, got {services!r}")
        self._api = client.DiscoveryV1Api(api_client)
        self._namespace = namespace
        self._services = dict(services)
        self._port_name = port_name
        self._watch_timeout = watch_timeout_seconds
        self.selector = f"{SERVICE_LABEL} in ({','.join(sorted(services))})"

    def _list(self) -> tuple[dict[str, list[Endpoint]], str]:
        result = self._api.list_namespaced_endpoint_slice(
            self._namespace, label_selector=self.selector
        )
        slices = {_name(item): self._endpoints(item) for item in result.items or []}
        # A list response always carries the collection's version; "" (watch from now) is the
        # API's own default should one lack it.
        meta = result.metadata
        return slices, (meta.resource_version if meta is not None else None) or ""

    def _endpoints(self, item: client.V1EndpointSlice) -> list[Endpoint]:
        raw = self._api.api_client.sanitize_for_serialization(item)
        return endpoints_from_slice(raw, self._services, self._port_name)

    async def snapshot(self) -> list[Endpoint]:
        slices, _ = await asyncio.to_thread(self._list)
        return merge(slices)

    async def watch(self) -> AsyncIterator[list[Endpoint]]:
        """List, yield, then follow watch events from the list's resourceVersion.

        A watch that ends (server timeout) resumes from the last version seen; one that is
        too old (410 Gone) starts over with a fresh list.
        """
        slices, version = await asyncio.to_thread(self._list)
        last = merge(slices)
        yield last
        while True:
            try:
                async for event in self._events(version):
                    kind, item = event["type"], event["object"]
                    if kind == "BOOKMARK":  # only the version moves; the object stays raw
                        version = item["metadata"]["resourceVersion"]
                        continue
                    version = item.metadata.resource_version or version
                    if kind == "DELETED":
                        slices.pop(item.metadata.name, None)
                    else:  # ADDED, MODIFIED
                        slices[item.metadata.name] = self._endpoints(item)
                    current = merge(slices)
                    if current != last:
                        last = current
                        yield current
            except ApiException as exc:
                if exc.status != 410:
                    raise
                log.info("endpointslice watch expired (410); relisting")
                slices, version = await asyncio.to_thread(self._list)
                current = merge(slices)
                if current != last:
                    last = current
                    yield current

    async def _events(self, version: str) -> AsyncIterator[dict[str, Any]]:
        """One watch request, run in a thread, its events handed over through a queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stream = watch.Watch()

        def pump() -> None:
            try:
                for event in stream.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self._namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self._watch_timeout,
                    _request_timeout=self._watch_timeout + 30,
                ):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
            except BaseException as exc:  # handed to the event loop and re-raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        thread = threading.Thread(target=pump, name="endpointslice-watch", daemon=True)
        thread.start()
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stream.stop()
