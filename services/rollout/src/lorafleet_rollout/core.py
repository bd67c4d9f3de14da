"""The rollout replica's domain logic: identity, capacity and validation around one engine.

The servicer translates protos to calls on `RolloutCore`; the engine only generates. Here a
request is validated, bounded (ResourceExhausted with retry_after rather than an unbounded
queue or an OOM), pinned to a resident adapter version for its whole life, and released.
Adapter pushes are verified by SHA-256, checked against the base model, and only then made
selectable; older versions retire once idle. The engine holds a bounded number of versions at a
time and this replica many more: a request for one not in the engine loads it, evicting the
least recently used idle one (`AdapterRegistry`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path

from lorafleet import validate_msgs
from lorafleet.errors import InvalidArgument, LorafleetError, NotFound, ResourceExhausted
from lorafleet.staging import MAX_ADAPTER_BYTES
from lorafleet_rollout import metrics
from lorafleet_rollout.adapters import (
    AdapterRegistry,
    Resident,
    adapter_id,
    check_ref,
    folder_digests,
    verify_digests,
)
from lorafleet_rollout.engine import RolloutEngine
from lorafleet_rollout.peft_io import CONFIG_FILE
from lorafleet_rollout.types import EngineInfo, LoraSpec, SampleRequest, SampleResult

log = logging.getLogger(__name__)

_OUTCOMES = {InvalidArgument: "invalid", NotFound: "not_found", ResourceExhausted: "exhausted"}


@dataclass(frozen=True)
class Limits:
    max_loaded_adapters: int = 16
    max_stored_adapters: int = 1024
    max_queued_requests: int = 256
    max_num_samples: int = 16
    max_adapter_bytes: int = MAX_ADAPTER_BYTES


class RolloutCore:
    def __init__(self, engine: RolloutEngine, limits: Limits, adapter_dir: Path) -> None:
        self.engine = engine
        self.limits = limits
        self.adapter_dir = adapter_dir
        self.registry = AdapterRegistry(limits.max_loaded_adapters, limits.max_stored_adapters)
        self.incarnation = uuid.uuid4().hex
        self._in_flight = 0
        #: Guards every change to what the engine holds (loads, evictions, drops, publishes);
        #: a request that needs a load waits on it for room. Sampling a loaded version never
        #: takes it.
        self._adapters = asyncio.Condition()
        self._waiting = 0
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        await self.engine.start()
        # The engine's own limit (SGLang's --max-loaded-loras) binds if it is the smaller:
        # loading past it would be refused there.
        engine_limit = self.engine.info().max_loaded_adapters
        if engine_limit:
            self.registry.max_loaded = min(self.registry.max_loaded, engine_limit)

    async def close(self) -> None:
        await self.engine.close()

    def info(self) -> EngineInfo:
        return self.engine.info()

    @property
    def max_loaded_adapters(self) -> int:
        """Versions the engine holds at once (the setting, or the engine's own smaller limit)."""
        return self.registry.max_loaded

    # ------------------------------------------------------------------ sampling
    async def sample(
        self, registration_id: str, version: int, request: SampleRequest
    ) -> SampleResult:
        try:
            info = self.engine.info()
            limits = validate_msgs.Limits(
                info.vocab_size, info.max_context_length, self.limits.max_num_samples
            )
            validate_msgs.check_sample(request, limits)
            if self._in_flight >= self.limits.max_queued_requests:
                raise ResourceExhausted(
                    f"{self._in_flight} requests are queued (limit "
                    f"{self.limits.max_queued_requests})",
                    retry_after=0.5,
                )
            entry = self.registry.acquire(registration_id, version)
        except LorafleetError as exc:
            metrics.REQUESTS.labels(_OUTCOMES.get(type(exc), "error")).inc()
            raise
        self._in_flight += 1
        metrics.QUEUE_DEPTH.set(self._in_flight)
        outcome = "error"
        try:
            if entry is not None:
                metrics.ADAPTER_LOOKUPS.labels("hit" if entry.loaded else "miss").inc()
                if not entry.loaded:
                    async with self._adapters:
                        await self._ensure_loaded(entry, cause="sample")
            # Tinker's rule: asking for the top-k prompt distribution returns the flat
            # per-token prompt logprobs beside it (both come off the same prompt pass).
            pinned = SampleRequest(
                None if entry is None else entry.adapter_id,
                request.prompt_tokens,
                request.params,
                request.num_samples,
                request.prompt_logprobs or request.topk_prompt_logprobs > 0,
                request.topk_prompt_logprobs,
            )
            result = await self.engine.sample(pinned)
            outcome = "ok"
            return result
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except LorafleetError as exc:
            outcome = _OUTCOMES.get(type(exc), "error")
            raise
        finally:
            self._in_flight -= 1
            metrics.QUEUE_DEPTH.set(self._in_flight)
            metrics.REQUESTS.labels(outcome).inc()
            if entry is not None:
                self._release(entry)

    # ------------------------------------------------------------------ publishing
    async def load_adapter(
        self,
        registration_id: str,
        version: int,
        lora: LoraSpec,
        staged: Path,
        digests: dict[str, str],
        measured: dict[str, str] | None = None,
        *,
        tenant: str = "",
    ) -> tuple[str, bool]:
        """Verify a staged PEFT folder and make it serve; returns (adapter_id, already_loaded).

        The version is loaded into the engine now (evicting the least recently used idle
        version if the engine is full, waiting for one to go idle if none is), so the engine
        checks its files before the publish is acknowledged and the first sample pays no load.
        `digests` are the announced SHA-256s; `measured` those the upload computed while
        staging (None: hash the folder's files here). `tenant` owns the registration: the
        engine's slots are shared fairly between tenants (`AdapterRegistry.victim`). Consumes
        `staged` (moved or deleted).
        """
        try:
            check_ref(registration_id, version, "header.adapter")
            lora = await asyncio.to_thread(_complete_spec, lora, staged)
            info = self.engine.info()
            if not 1 <= lora.rank <= info.max_lora_rank:
                raise InvalidArgument(
                    f"rank {lora.rank} is outside [1, {info.max_lora_rank}]",
                    field="header.lora_config.rank",
                )
            if measured is None:
                measured = await asyncio.to_thread(folder_digests, staged)
            verify_digests(digests, measured)
            async with self._adapters:
                plan = self.registry.plan_load(registration_id, version, digests)
                engine_id = adapter_id(registration_id, version)
                if plan.already_loaded:
                    return engine_id, True
                folder = self.adapter_dir / f"{engine_id}-{uuid.uuid4().hex[:8]}"
                await asyncio.to_thread(staged.rename, folder)
                entry = Resident(
                    registration_id, version, lora, digests, folder, tenant=tenant, in_flight=1
                )
                self.registry.add(entry)
                self._count()
                try:
                    await self._ensure_loaded(entry, cause="publish")
                except BaseException:
                    # The engine refused the files (or we were cancelled): the version was
                    # never acknowledged, so it leaves no trace.
                    entry.retiring = True
                    await self._drop(entry)
                    raise
                finally:
                    entry.in_flight -= 1
                    self._adapters.notify_all()
                for spare in self.registry.over_stored():
                    await self._drop(spare)
                log.info("adapter %s published", engine_id)
                return engine_id, False
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    async def unload_adapter(self, registration_id: str, version: int) -> None:
        """Version 0 retires the whole registration for good; otherwise one version."""
        if not registration_id:
            raise InvalidArgument("the base model cannot be unloaded", field="adapter")
        if version < 0:
            raise InvalidArgument(f"version {version} is negative", field="adapter.version")
        async with self._adapters:
            if version == 0:
                idle = self.registry.retire_registration(registration_id)
            else:
                idle = self.registry.retire_version(registration_id, version)
            for entry in idle:
                await self._drop(entry)
            # Requests waiting to load a version retired just now are refused at once.
            self._adapters.notify_all()

    def list_adapters(self) -> list[Resident]:
        return sorted(self.registry.resident.values(), key=lambda r: r.adapter_id)

    # ------------------------------------------------------------------ the cache
    async def _ensure_loaded(self, entry: Resident, cause: str) -> None:
        """Load a pinned version into the engine, making room by evicting the least recently
        used idle version, or waiting until one goes idle. Called with `_adapters` held, so
        loads run one at a time and a version is loaded once however many requests wait."""
        while not entry.loaded:
            if entry.retiring or self.registry.resident.get(entry.adapter_id) is not entry:
                # Superseded or retired while this request waited: never loaded again.
                raise self.registry.not_resident(entry.registration_id, entry.version)
            if await self._make_room(entry):
                await self._load(entry, cause)
                return
            self._waiting += 1
            try:
                await self._adapters.wait()
            finally:
                self._waiting -= 1

    async def _make_room(self, entry: Resident) -> bool:
        """Free one engine slot if none is free, for `entry`; False when every loaded version
        is pinned. Called with `_adapters` held."""
        for idle in self.registry.idle_retiring():
            await self._drop(idle)
        rank_class = self.engine.info().rank_class
        while self.registry.loaded_count() >= self.registry.max_loaded:
            victim = self.registry.victim(entry.tenant, entry.rank, rank_class)
            if victim is None:
                return False
            await self._evict(victim)
        return True

    async def _load(self, entry: Resident, cause: str) -> None:
        assert entry.folder is not None
        started = time.monotonic()
        await self.engine.load_adapter(entry.adapter_id, entry.folder, entry.lora)
        entry.loaded = True
        metrics.ADAPTER_LOADS.labels(cause).inc()
        metrics.ADAPTER_LOAD_SECONDS.observe(time.monotonic() - started)
        self._count()
        log.debug("adapter %s loaded (%s)", entry.adapter_id, cause)

    async def _evict(self, entry: Resident) -> None:
        """Take an idle version out of the engine; its files stay, to load it again."""
        entry.loaded = False
        try:
            await self.engine.unload_adapter(entry.adapter_id)
        finally:
            metrics.ADAPTER_EVICTIONS.inc()
            self._count()
            log.debug("adapter %s evicted", entry.adapter_id)

    async def _drop(self, entry: Resident) -> None:
        """Forget an idle version: out of the engine and off this replica's disk."""
        if not self.registry.remove(entry):
            return
        try:
            if entry.loaded:
                entry.loaded = False
                await self.engine.unload_adapter(entry.adapter_id)
        finally:
            if entry.folder is not None:
                shutil.rmtree(entry.folder, ignore_errors=True)
            self._count()
            log.info("adapter %s dropped", entry.adapter_id)

    def _release(self, entry: Resident) -> None:
        """Unpin after a request; drop a retiring version that went idle, and wake requests
        waiting for room when a loaded version becomes evictable."""
        if self.registry.release(entry):
            self._later(self._drop_if_idle(entry))
        elif entry.in_flight == 0 and entry.loaded and self._waiting:
            self._later(self._wake())

    async def _drop_if_idle(self, entry: Resident) -> None:
        async with self._adapters:
            if entry.in_flight == 0:
                await self._drop(entry)
            self._adapters.notify_all()

    async def _wake(self) -> None:
        async with self._adapters:
            self._adapters.notify_all()

    def _later(self, work: Coroutine[None, None, None]) -> None:
        """Run cache upkeep without delaying the response that triggered it."""

        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("adapter cache upkeep failed")

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _count(self) -> None:
        metrics.ADAPTERS_LOADED.set(self.registry.loaded_count())
        metrics.ADAPTERS_STORED.set(len(self.registry.resident))


def _complete_spec(lora: LoraSpec, staged: Path) -> LoraSpec:
    """Fill rank/alpha the header left at 0 from adapter_config.json; refuse a mismatch."""
    try:
        config = json.loads((staged / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"unreadable: {exc}", field=CONFIG_FILE) from None
    rank = int(config.get("r", 0))
    if lora.rank and lora.rank != rank:
        raise InvalidArgument(
            f"header rank {lora.rank} differs from adapter_config.json r={rank}",
            field="header.lora_config.rank",
        )
    alpha = float(config.get("lora_alpha", lora.alpha))
    targets = config.get("target_modules") or lora.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return LoraSpec(rank, alpha, targets)
