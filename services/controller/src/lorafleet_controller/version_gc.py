"""Published adapter versions that nothing holds leave Redis, the rollouts and the disk.

An RL loop publishes a version every step; kept forever, they fill the shared disk and
Redis. A version is held while any of these stands (store/adapters.py, the `adapter_refs`
set and the `run_newest` hash, kept by the scripts that change them):
- a snapshot sampler pins it (until the sampler's session expires: a session owns its
  sampling sessions, tenancy.py);
- a sampler checkpoint (`tinker://.../sampler_weights/<name>`) names it, until it is
  deleted or expires;
- it is its run's newest version, which the run's inflight samplers follow (a retired
  run's too, so its samplers still serve, until the run's record is forgotten:
  registry.expire_retired).

The moment the last of these goes, the same script queues the version in `versions_unheld`.
The leader's sweep collects a version `grace_seconds` after that (a sample dispatched to it
just before, say by an inflight sampler as a newer version landed, finishes first):
`version_collect.lua` checks again that nothing holds it, drops its record and its
live-index entry, and queues its folder for the reclaimer (reclaim.py, which removes it a
grace later), in one step. Then every healthy rollout of its base model is told to unload
it (best effort: a rollout that misses it drops it from its own bounded cache in time, and
nothing will ask it for the version again). A sampler recorded for a version collected
meanwhile is refused (record_sampler.lua), so nothing can pin what is gone; a sampler made
from a training checkpoint takes a version of its own, held for it from the step that
records the version (publish_live.lua), so it is never collected before the sampler exists.

Versions published before this existed were never queued and stay (no backfill).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lorafleet import errors
from lorafleet.contract import AdapterId
from lorafleet.v1 import common_pb2
from lorafleet_controller.clients import Pool
from lorafleet_controller.registry import ROLLOUT, Registry
from lorafleet_controller.store import Store
from lorafleet_controller.store.adapters import AdaptersRepo
from lorafleet_controller.store.catalog import SAMPLER, Reclaim

log = logging.getLogger(__name__)

BATCH = 256  # versions looked at per sweep; the rest wait for the next one


class VersionCollector:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        pool: Pool,
        grace_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repo = AdaptersRepo(store)
        self.registry = registry
        self.pool = pool
        self.grace = grace_seconds
        self.clock = clock

    async def collect_due(self) -> int:
        """Collect the versions let go at least a grace ago that nothing holds again; how
        many were collected."""
        now = self.clock()
        cutoff = now - self.grace
        collected = 0
        for aid in await self.repo.unheld(cutoff, BATCH):
            live = await self.repo.live(aid)
            folder = live.folder if live is not None else ""
            size = sum(r.size_bytes for r in live.refs.values()) if live is not None else 0
            entry = Reclaim(
                tinker_path=f"version:{aid}",
                folder=folder,
                tenant=live.tenant if live is not None else "",
                type=SAMPLER,
                size_bytes=size,
                removed_at=now,
                manifest=common_pb2.BlobRef(),
            )
            if await self.repo.collect(aid, cutoff, entry.encode()) != "collected":
                continue
            collected += 1
            assert live is not None  # collected: its record existed until the script
            await self._unload(live.base_model, AdapterId.parse(aid))
        return collected

    async def _unload(self, base_model: str, aid: AdapterId) -> None:
        ref = common_pb2.AdapterRef(registration_id=aid.registration_id, version=aid.version)
        for rep in await self.registry.replicas(ROLLOUT, base_model):
            if not rep.healthy:
                continue
            try:
                await self.pool.rollout(rep.address).unload_adapter(ref)
            except errors.LorafleetError as exc:
                log.warning("unloading collected %s from %s failed: %s", aid, rep.replica_id, exc)
        log.info("collected %s: nothing held it", aid)
