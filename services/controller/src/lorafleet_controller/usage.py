"""Per-tenant usage for chargeback: durable totals in Redis, exported as Prometheus metrics.

Counted where the work is recorded, exactly once: an operation's usage travels as `usage`
effects with its outcome, and the `complete` script adds them to the tenant's totals in the
same transaction that records the outcome (a re-dispatched or swept operation is recorded
once, so it is counted once; a failed one is not counted).

- tokens_trained / tokens_forward: target tokens of successful forward_backward / forward
  operations (one per `logprobs` entry the trainer returned, i.e. per model-input token);
- tokens_sampled / tokens_prompt: tokens generated over every returned sequence / prompt
  tokens of a successful sample request (prefilled once per request);
- optim_steps: steps that changed the weights (a step vetoed for non-finite gradients is
  not counted);
- adapter_seconds: seconds the tenant's registrations held a trainer slot, summed over slots;
  integrated by the leader's sweeper from the slot tables (resolution: one sweep interval);
- stored_bytes: bytes of the tenant's checkpoints in the catalog now (derived on read).

Totals live in `usage:<tenant>` hashes (store/usage.py), so they survive controller restarts
and failovers; the leading controller exports them as Prometheus counters, read back at every
sweep (a new leader exports the same totals, never a reset).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2
from lorafleet_controller.registry import TRAINER, Registry
from lorafleet_controller.store import Store
from lorafleet_controller.store.usage import UsageRepo

Effects = list[tuple[str, str, Any]]
COUNTERS = (
    "tokens_trained",
    "tokens_forward",
    "tokens_sampled",
    "tokens_prompt",
    "optim_steps",
    "adapter_seconds",
)
MAX_TICK_SECONDS = 60.0  # a longer gap between sweeps (no leader, a pause) is not billed


def _effect(field: str, n: int) -> Effects:
    return [("usage", field, n)] if n else []


def forward_effects(kind: int, target_tokens: int) -> Effects:
    """Usage of a successful forward / forward_backward: the target tokens the trainer
    reports for it (ForwardBackwardItemResult.target_tokens)."""
    forward = kind == controller_pb2.OPERATION_KIND_FORWARD
    return _effect("tokens_forward" if forward else "tokens_trained", target_tokens)


def optim_effects(output: common_pb2.OptimStepOutput) -> Effects:
    return _effect("optim_steps", 1 if output.applied else 0)


def sample_effects(payload: bytes, output: common_pb2.SampleOutput) -> Effects:
    """Usage of a successful sample: its prompt, and every token it generated."""
    prompt = len(rollout_pb2.SampleRequest.FromString(payload).prompt_tokens)
    return _effect("tokens_prompt", prompt) + _effect(
        "tokens_sampled", sum(len(s.tokens) for s in output.sequences)
    )


class Usage:
    """Reads the totals, integrates slot residency, and feeds the Prometheus collector."""

    def __init__(
        self, store: Store, registry: Registry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.repo = UsageRepo(store)
        self.registry = registry
        self.clock = clock
        self._last: float | None = None  # the previous residency tick (this leader's)

    async def tick(self) -> None:
        """Add the time since the last tick to every tenant holding trainer slots, then
        refresh the exported snapshot. Called by the leader's sweeper; the billing is fenced,
        so a deposed leader's tick raises StaleEpoch instead of billing the seconds twice."""
        now = self.clock()
        dt, self._last = (0.0 if self._last is None else now - self._last), now
        if 0 < dt <= MAX_TICK_SECONDS:
            await self._add_residency(dt)
        _COLLECTOR.snapshot = await self.totals()

    def forget_tick(self) -> None:
        """This controller stopped leading: residency restarts from its next tick, and it
        exports nothing until then (the new leader exports the totals; two exporters would
        be summed twice)."""
        self._last = None
        _COLLECTOR.snapshot = []

    async def _add_residency(self, dt: float) -> None:
        trainers = await self.registry.replicas(TRAINER)
        tables = await self.registry.slot_tables([r.replica_id for r in trainers])
        rids = [rid for table in tables.values() for rid in table.values() if rid]
        await self.repo.add_residency(rids, dt)

    async def totals(self, tenant: str = "") -> list[controller_pb2.TenantUsage]:
        """One tenant's totals (zeros when it has none), or every tenant's with any usage."""
        tenants = [tenant] if tenant else await self.repo.tenants()
        return [
            controller_pb2.TenantUsage(**dataclasses.asdict(row))
            for row in await self.repo.totals(tenants)
        ]


class _UsageCollector(Collector):
    """Exports the newest snapshot the sweeper read (one per process, for every Usage)."""

    def __init__(self) -> None:
        self.snapshot: list[controller_pb2.TenantUsage] = []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows: Iterable[controller_pb2.TenantUsage] = self.snapshot
        for name in COUNTERS:
            fam = CounterMetricFamily(
                f"lorafleet_tenant_{name}",
                f"Per-tenant usage: {name} (see usage.py).",
                labels=["tenant"],
            )
            for row in rows:
                fam.add_metric([row.tenant], getattr(row, name))
            yield fam
        gauge = GaugeMetricFamily(
            "lorafleet_tenant_stored_bytes",
            "Bytes of the tenant's stored checkpoints.",
            labels=["tenant"],
        )
        for row in rows:
            gauge.add_metric([row.tenant], row.stored_bytes)
        yield gauge


_COLLECTOR = _UsageCollector()
REGISTRY.register(_COLLECTOR)
