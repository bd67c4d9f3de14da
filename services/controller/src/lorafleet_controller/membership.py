"""Keep the registry in step with what discovery sees (static list or EndpointSlices).

Discovery is authoritative for presence, the replica itself for identity. An endpoint that
vanishes or turns not-ready is lost at once (a trainer's registrations become UNAVAILABLE
and re-queue; a rollout stops receiving pushes), without waiting for missed heartbeats. A
new or changed endpoint is probed (GetTrainerInfo / GetRolloutInfo) and admitted exactly as
a RegisterReplica call would be, so a restarted rollout pod (new incarnation) or one that
turned ready again is reconciled with every live adapter. Ready endpoints are re-probed
every heartbeat interval: that refreshes `last_seen` for replicas that never self-register
(static mode) and notices a restart even when the address did not change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from lorafleet import errors, quantize
from lorafleet_controller.clients import Pool
from lorafleet_controller.discovery.types import Discovery, Endpoint
from lorafleet_controller.loops import raise_if_stopped
from lorafleet_controller.registry import TRAINER, Registry, Replica, base_model_name

log = logging.getLogger(__name__)

Admit = Callable[[Replica], Awaitable[str]]
Lose = Callable[[str, str], Awaitable[None]]


class Membership:
    def __init__(
        self,
        discovery: Discovery,
        registry: Registry,
        pool: Pool,
        admit: Admit,
        lose: Lose,
        probe_interval: float,
        probe_timeout: float = 5.0,
        restart_delay: float = 1.0,
    ) -> None:
        self.discovery = discovery
        self.registry = registry
        self.pool = pool
        self.admit = admit
        self.lose = lose
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.restart_delay = restart_delay
        self._ready: dict[tuple[str, str], Endpoint] = {}
        self._ids: dict[tuple[str, str], str] = {}  # endpoint -> replica id it reported
        self._probes: dict[Endpoint, asyncio.Task[str | None]] = {}

    async def run(self) -> None:
        """Follow discovery until cancelled; a failed watch restarts after a pause."""
        prober = asyncio.create_task(self._probe_loop(), name="membership-probe")
        try:
            while True:
                try:
                    async for endpoints in self.discovery.watch():
                        await self.update(endpoints)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.warning("replica discovery failed; restarting it", exc_info=True)
                raise_if_stopped()
                await asyncio.sleep(self.restart_delay)
        finally:
            # Probes run as their own tasks, never inside this one: a gRPC call cancelled
            # mid-flight may surface as an RPC error rather than CancelledError, and must not
            # swallow this task's cancellation. The wait is bounded for the same reason.
            pending = {prober, *self._probes.values()}
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=self.probe_timeout + 1)

    async def update(self, endpoints: list[Endpoint]) -> None:
        """Apply one full endpoint list: lose what left, probe what is new or moved."""
        ready = {(e.kind, e.replica_id): e for e in endpoints if e.ready}
        gone = [key for key in self._ready if key not in ready]
        joined = [e for key, e in ready.items() if self._ready.get(key) != e]
        self._ready = ready
        for kind, endpoint_id in gone:
            replica_id = self._ids.pop((kind, endpoint_id), endpoint_id)
            await self.lose(
                replica_id, f"{kind} replica {replica_id} left discovery (removed or not ready)"
            )
        for e in joined:
            self._spawn_probe(e)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            for e in list(self._ready.values()):
                self._spawn_probe(e)

    def _spawn_probe(self, endpoint: Endpoint) -> None:
        """Probe in the background (one at a time per endpoint), so a slow or unreachable
        replica never delays the handling of the next discovery event."""
        if endpoint in self._probes:
            return
        task = asyncio.create_task(self.probe(endpoint))
        self._probes[endpoint] = task
        task.add_done_callback(lambda _: self._probes.pop(endpoint, None))

    async def probe(self, endpoint: Endpoint) -> str | None:
        """Ask the replica who it is and admit it. None when it did not answer in time."""
        try:
            async with asyncio.timeout(self.probe_timeout):
                rep = await self.describe(endpoint)
        except (errors.LorafleetError, TimeoutError) as exc:
            log.info(
                "probing %s %s at %s failed: %s",
                endpoint.kind,
                endpoint.replica_id,
                endpoint.address,
                exc,
            )
            return None
        if (endpoint.kind, endpoint.replica_id) not in self._ready:
            return None  # it left while we were asking
        self._ids[(endpoint.kind, endpoint.replica_id)] = rep.replica_id
        return await self.admit(rep)

    async def describe(self, endpoint: Endpoint) -> Replica:
        """The registry record for an endpoint, from the replica's own info.

        What only self-registration reports (tokenizer, arch) is kept from the existing
        record, and so is its address while the incarnation is unchanged (a self-registered
        DNS name and a discovered pod IP reach the same process; flipping between them would
        only churn channels).
        """
        if endpoint.kind == TRAINER:
            t = await self.pool.trainer(endpoint.address).info(retry=False)
            replica_id, base, incarnation = t.replica_id, t.base_model, t.incarnation
            slots, max_rank, context, loss_fns = (
                t.num_slots,
                t.max_rank,
                t.max_context_length,
                list(t.loss_fns),
            )
            samples, quantization = 0, t.quantization
        else:
            r = await self.pool.rollout(endpoint.address).info(retry=False)
            replica_id, base, incarnation = r.replica_id, r.base_model, r.incarnation
            slots, max_rank, context, loss_fns = (
                r.max_loaded_adapters,
                r.max_lora_rank,
                r.max_context_length,
                [],
            )
            samples, quantization = r.max_num_samples, r.quantization
        replica_id = replica_id or endpoint.replica_id
        old = await self.registry.replica(replica_id)
        same = old is not None and old.incarnation == incarnation and old.kind == endpoint.kind
        return Replica(
            kind=endpoint.kind,
            replica_id=replica_id,
            address=old.address if same and old is not None else endpoint.address,
            base_model=base_model_name(base),
            num_slots=slots,
            incarnation=incarnation,
            last_seen=0,
            healthy=True,
            tokenizer_id=old.tokenizer_id if old else "",
            max_rank=max_rank,
            max_context_length=context,
            arch=old.arch if old else "",
            loss_fns=loss_fns or (old.loss_fns if old else []),
            max_num_samples=samples,
            quantization=quantization or quantize.NONE,
        )
