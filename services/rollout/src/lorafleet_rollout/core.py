"""The rollout replica's domain logic: identity, capacity and validation around one engine.

The servicer translates protos to calls on `RolloutCore`; the engine only generates. Here a
request is validated, bounded (ResourceExhausted with retry_after rather than an unbounded
queue or an OOM), pinned to a resident adapter version for its whole life, and released.
Adapter pushes are verified by SHA-256, checked against the base model, and only then made
selectable; older versions retire once idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
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
    max_queued_requests: int = 256
    max_num_samples: int = 16
    versions_per_registration: int = 2
    max_adapter_bytes: int = MAX_ADAPTER_BYTES


class RolloutCore:
    def __init__(self, engine: RolloutEngine, limits: Limits, adapter_dir: Path) -> None:
        self.engine = engine
        self.limits = limits
        self.adapter_dir = adapter_dir
        self.registry = AdapterRegistry(
            limits.max_loaded_adapters, limits.versions_per_registration
        )
        self.incarnation = uuid.uuid4().hex
        self._in_flight = 0
        self._publish = asyncio.Lock()
        self._unloads: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

    def info(self) -> EngineInfo:
        return self.engine.info()

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
            engine_id = self.registry.acquire(registration_id, version)
        except LorafleetError as exc:
            metrics.REQUESTS.labels(_OUTCOMES.get(type(exc), "error")).inc()
            raise
        self._in_flight += 1
        metrics.QUEUE_DEPTH.set(self._in_flight)
        outcome = "error"
        try:
            # Tinker's rule: asking for the top-k prompt distribution returns the flat
            # per-token prompt logprobs beside it (both come off the same prompt pass).
            pinned = SampleRequest(
                engine_id,
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
            if engine_id is not None and self.registry.release(engine_id):
                self._unload_later(engine_id)

    # ------------------------------------------------------------------ publishing
    async def load_adapter(
        self,
        registration_id: str,
        version: int,
        lora: LoraSpec,
        staged: Path,
        digests: dict[str, str],
        measured: dict[str, str] | None = None,
    ) -> tuple[str, bool]:
        """Verify a staged PEFT folder and make it serve; returns (adapter_id, already_loaded).

        `digests` are the announced SHA-256s; `measured` those the upload computed while
        staging (None: hash the folder's files here). Consumes `staged` (moved or deleted).
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
            async with self._publish:
                plan = self.registry.plan_load(registration_id, version, digests)
                engine_id = adapter_id(registration_id, version)
                if plan.already_loaded:
                    return engine_id, True
                for entry in self.registry.retire(plan.retire):
                    await self._unload(entry)
                for entry in self.registry.idle_retiring():
                    await self._unload(entry)
                folder = self.adapter_dir / f"{registration_id}@{version}-{uuid.uuid4().hex[:8]}"
                await asyncio.to_thread(staged.rename, folder)
                try:
                    await self.engine.load_adapter(engine_id, folder, lora)
                except BaseException:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
                self.registry.add(Resident(registration_id, version, lora.rank, digests, folder))
                metrics.ADAPTERS_LOADED.set(len(self.registry.resident))
                log.info("adapter %s loaded", engine_id)
                return engine_id, False
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    async def unload_adapter(self, registration_id: str, version: int) -> None:
        """Version 0 retires the whole registration for good; otherwise one version."""
        if not registration_id:
            raise InvalidArgument("the base model cannot be unloaded", field="adapter")
        if version < 0:
            raise InvalidArgument(f"version {version} is negative", field="adapter.version")
        async with self._publish:
            if version == 0:
                idle = self.registry.retire_registration(registration_id)
            else:
                idle = self.registry.retire_version(registration_id, version)
            for entry in idle:
                await self._unload(entry)

    def list_adapters(self) -> list[Resident]:
        return sorted(self.registry.resident.values(), key=lambda r: r.adapter_id)

    async def _unload(self, entry: Resident) -> None:
        if self.registry.remove(entry.adapter_id) is None:
            return
        try:
            await self.engine.unload_adapter(entry.adapter_id)
        finally:
            if entry.folder is not None:
                shutil.rmtree(entry.folder, ignore_errors=True)
            metrics.ADAPTERS_LOADED.set(len(self.registry.resident))
            log.info("adapter %s unloaded", entry.adapter_id)

    def _unload_later(self, engine_id: str) -> None:
        """A retiring version just went idle: unload it without delaying the response."""

        async def run() -> None:
            entry = self.registry.resident.get(engine_id)
            if entry is None:
                return
            try:
                async with self._publish:
                    if entry.in_flight == 0:
                        await self._unload(entry)
            except Exception:
                log.exception("unloading %s failed", engine_id)

        task = asyncio.get_running_loop().create_task(run())
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)


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
