"""The publish barrier: save_weights_for_sampler completes when the version is durable and
its registration's home rollout serves it.

Steps of one publish (each idempotent, so a re-dispatch after a controller crash is safe):
the version number is allocated once and stored on the operation; the trainer streams the
slot's PEFT adapter (ExportAdapter); the files are written once under the storage root
(they are the durable sampler checkpoint, and the source any rollout loads the version from
later) and recorded live; the registration's home rollout (placement.py: one replica per
registration, balanced by capacity) receives them (LoadAdapter, verified by SHA-256) under
`<registration>@<version>`; only when it acknowledged does the operation succeed and the
registration's published_version move. A home that is restarting is waited for; one lost
meanwhile is replaced by another home; one that refuses the version fails the operation
with its name.

What a user sees: the first sample after a publish runs on the home, which holds the
version. Any other rollout (a hot adapter spreading, a home that moved) loads the version on
its first sample there from the checkpoint store: that sample pays one load's latency, never
an error, and no sample issued after the publish runs on an older version (samplers pin
versions by id, and inflight samplers resolve the newest published version at dispatch).
Capacity grows with rollouts: each holds the registrations homed on it, not all of them.
Rollouts that (re)start or join are reconciled: they receive the newest live versions of
the registrations homed on them, and a joining one takes its share of homes from the others
(`rebalance`).

Where every replica mounts the same storage (`shared_adapter_root`, lorafleet.shared_storage)
the adapter travels by reference instead: the trainer writes the version's folder there
(WriteSharedAdapter) and each rollout gets a header with every file's URI and SHA-256 and
reads the files itself, so no adapter bytes pass through the controller's memory. The
folder is then the durable sampler checkpoint. Without it, today's streamed push.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet import durable, errors
from lorafleet.contract import AdapterId, CheckpointKind, TinkerPath
from lorafleet.shared_storage import FileRef, adapter_folder, common_folder, publish_folder
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller import metrics
from lorafleet_controller.catalog import SAMPLER, Catalog, CheckpointRecord, copy_files
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.ledger import Claim
from lorafleet_controller.placement import rebalance
from lorafleet_controller.registry import ROLLOUT, Registry, RegRecord, Replica
from lorafleet_controller.residency import Homes, Payload, Pusher, payload_of
from lorafleet_controller.samplers import SamplerRecord, Samplers
from lorafleet_controller.store import RegState, Store
from lorafleet_controller.store.adapters import AdaptersRepo, LiveVersion

log = logging.getLogger(__name__)

Effects = list[tuple[str, str, Any]]


class Publisher:
    def __init__(
        self,
        store: Store,
        storage_root: Path,
        registry: Registry,
        catalog: Catalog,
        samplers: Samplers,
        pool: Pool,
        resident_versions: int,
        shared_root: Path | None = None,
        *,
        rollout_wait_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.repo = AdaptersRepo(store)
        self.pusher = Pusher(self.repo, pool)
        self.homes = Homes(store)
        self.storage_root = storage_root
        self.registry = registry
        self.catalog = catalog
        self.samplers = samplers
        self.pool = pool
        self.resident_versions = resident_versions
        self.shared_root = shared_root
        self.rollout_wait_seconds = rollout_wait_seconds
        self.clock = clock

    async def publish(
        self, claim: Claim, sw: controller_pb2.SaveWeightsForSamplerPayload
    ) -> tuple[controller_pb2.OperationResult, Effects]:
        start = time.monotonic()
        reg = await self.registry.get_any(claim.registration_id)
        if reg is None:
            raise errors.NotFound("registration vanished", field="registration_id")
        _require_bound(reg, claim)
        version = await self.repo.allocate_version(
            claim.registration_id, claim.operation_id, fenced=True
        )
        ref = common_pb2.AdapterRef(registration_id=claim.registration_id, version=version)
        aid = str(AdapterId(claim.registration_id, version))
        live = await self._live(aid)
        if live is not None:
            # An earlier attempt of this operation made the version live (a rollout may
            # serve it) and died before its outcome was recorded: push those very files.
            # Exported again after a restore, the replayed weights may differ in the last
            # bits (recovery.py), and a rollout refuses a version's files changing; removed
            # by a re-run that found the slot rebound (below), a live version lost its files
            # (CAMPAIGN_FAULTS=100, seed 2026: version 3 of the sampling tenant).
            folder, payload = live
        elif self.shared_root is not None:
            trainer = await self._trainer(claim)
            refs = await trainer.write_shared_adapter(claim.slot, claim.registration_id, version)
            folder = await asyncio.to_thread(_shared_folder, self.shared_root, refs)
            try:
                await self._still_bound(reg, claim)
            except errors.FailedPrecondition:  # the re-run must export afresh, not reuse it
                if await self._live(aid) is None:  # unless another attempt made it live
                    await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)
                raise
            payload = Payload(refs=refs)
        else:
            trainer = await self._trainer(claim)
            files = await trainer.export_adapter(claim.slot, claim.registration_id)
            await self._still_bound(reg, claim)
            folder = await asyncio.to_thread(
                self._write, claim.registration_id, version, _bytes_writer(files)
            )
            payload = Payload(files=files)
        record = LiveVersion(ref, reg.base_model, reg.lora, folder, payload.refs, reg.tenant)
        if live is None:
            await self.repo.record_live(record, self.clock(), fenced=True)
        await self.push_home(record, payload)
        path = ""
        if sw.name:
            kind = CheckpointKind.SAMPLER_WEIGHTS
            path = str(TinkerPath(claim.registration_id, kind, sw.name))
            await self.catalog.add(
                tinker_path=path,
                tenant=claim.tenant,
                type=SAMPLER,
                base_model=reg.base_model,
                lora=reg.lora,
                files_dir=folder,
                version=version,
                ttl_seconds=sw.ttl_seconds,
                user_metadata=dict(sw.user_metadata),
                size_bytes=payload.size_bytes,
                files=payload.digests(),
            )
        sampler_id = ""
        if sw.sampler_session_id:
            sampler_id = sw.sampler_session_id
            await self.samplers.record(
                sampler_id=sampler_id,
                tenant=claim.tenant,
                base_model=reg.base_model,
                model_path=path,
                ref=ref,
                inflight=sw.kind == "inflight",
            )
        metrics.PUBLISH_LATENCY.observe(time.monotonic() - start)
        result = controller_pb2.OperationResult(
            save_weights_for_sampler=controller_pb2.SaveWeightsForSamplerResult(
                path=path, sampler_id=sampler_id, version=version
            )
        )
        return result, [("set", "published_version", version)]

    async def _trainer(self, claim: Claim) -> TrainerClient:
        rep = await self.registry.replica(claim.replica)
        if rep is None:
            raise errors.Unavailable(f"trainer replica {claim.replica!r} is gone")
        return self.pool.trainer(rep.address)

    async def _still_bound(self, before: RegRecord, claim: Claim) -> None:
        """The export read the slot the registration held when the publish began.

        Neither the trainer's export nor its transport retries are fenced by lease or
        incarnation, so an export retried across a trainer restart can land in the middle of
        the run's restore: after the fresh bind, before the snapshot and replay (the fault
        campaign at 100 faults published a version with the initial weights, and another
        with the weights of four steps earlier). Every bind changes `bound_at`, so an
        unchanged READY record means the slot was never rebuilt meanwhile."""
        now = await self.registry.get_any(claim.registration_id)
        if now is None:
            raise errors.NotFound("registration vanished", field="registration_id")
        _require_bound(now, claim)
        if now.bound_at != before.bound_at:
            raise errors.FailedPrecondition(
                f"{claim.registration_id} was bound again while its adapter was exported",
                field="registration_id",
                reason="LEASE_MISMATCH",
            )

    def _write(self, rid: str, version: int, fill: Callable[[Path], None]) -> str:
        """Blocking: a version's folder under the storage root, written once by `fill`
        (worker thread); a `fill` that fails leaves nothing."""
        folder = self.storage_root / "adapters" / rid / str(version)
        if folder.is_dir():
            return str(folder)
        tmp = folder.with_name(f"{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            fill(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        durable.commit_folder(tmp, folder)
        return str(folder)

    async def sampler_from_checkpoint(
        self, ckpt: CheckpointRecord, sampler_id: str, tenant: str, model_path: str
    ) -> SamplerRecord:
        """A sampler on a training checkpoint: its adapter becomes a new live version of the
        run (written once, pushed to the run's home rollout) and the sampler pins that version. On
        shared storage the controller writes it there once and rollouts read it by reference
        (its bytes pass through here once, not once per rollout).

        The checkpoint's files are copied in blocks, each checked against the checkpoint's
        manifest on the way (catalog.copy_files): a link, a folder elsewhere or a size that
        differs is refused before a version is taken; bytes that differ fail the copy,
        which leaves no folder and records nothing."""
        stored = await self.catalog.files(ckpt)
        version = await self.repo.allocate_version(ckpt.training_run_id, "", fenced=False)
        ref = common_pb2.AdapterRef(registration_id=ckpt.training_run_id, version=version)
        copy = functools.partial(copy_files, stored)
        refs: dict[str, common_pb2.BlobRef] = {}
        if self.shared_root is not None:
            folder, refs = await asyncio.to_thread(
                _write_shared, self.shared_root, ckpt.training_run_id, version, copy
            )
        else:
            folder = await asyncio.to_thread(self._write, ckpt.training_run_id, version, copy)
        record = LiveVersion(ref, ckpt.base_model, ckpt.lora, folder, refs, tenant)
        await self.repo.record_live(record, self.clock(), fenced=False, sampler_id=sampler_id)
        await self.push_home(record, await payload_of(record))
        return await self.samplers.record(
            sampler_id=sampler_id,
            tenant=tenant,
            base_model=ckpt.base_model,
            model_path=model_path,
            ref=ref,
            inflight=False,
        )

    async def push_home(self, live: LiveVersion, payload: Payload) -> None:
        """Load the version on its registration's home rollout; the home must ack.

        The home is read again on every pass, because a rollout restarting under the
        supervisor (or rescheduled at another address) is the normal case, not a failure the
        SDK could retry: the publish's seq_id is spent once it fails (CAMPAIGN_FAULTS=500
        failed save_weights_for_sampler on a rollout's refused connection). So a push refused
        as Unavailable is tried again, with backoff, for `rollout_wait_seconds` from the
        first refusal, at the address the replica announces now; a home the controller has
        meanwhile lost (silent past its heartbeat, or failed for good) is replaced by another
        healthy rollout, which is pushed instead. With no healthy rollout the version stays
        recorded live: `reconcile` gives it to its home when one comes up, and a sample loads
        it wherever it runs. An ack counts for the incarnation that gave it; a restarted home
        is pushed again. Any other refusal (a checksum, a rank the rollout cannot serve)
        fails the publish at once, naming the replica."""
        ref, base_model = live.ref, live.base_model
        loop = asyncio.get_running_loop()
        acked: set[tuple[str, str]] = set()
        deadline: float | None = None
        delay = 0.05
        while True:
            rollouts = [r for r in await self.registry.replicas(ROLLOUT, base_model) if r.healthy]
            if not rollouts:
                return
            home = await self.homes.home(ref.registration_id, base_model, rollouts)
            if (home.replica_id, home.incarnation) in acked:
                return
            try:
                await self.pusher.load(home.address, live, payload, retry=False)
            except errors.Unavailable as exc:
                waiting = f"{home.replica_id} ({exc})"
            except errors.LorafleetError as exc:
                raise errors.Unavailable(
                    f"rollout replicas did not acknowledge {ref.registration_id}@{ref.version}: "
                    f"{home.replica_id} ({exc})",
                    reason="PUBLISH_INCOMPLETE",
                ) from None
            else:
                acked.add((home.replica_id, home.incarnation))
                continue  # read the home again: it may have restarted or moved since
            now = loop.time()
            deadline = now + self.rollout_wait_seconds if deadline is None else deadline
            if now >= deadline:
                raise errors.Unavailable(
                    f"rollout replicas did not acknowledge {ref.registration_id}@{ref.version}: "
                    + waiting,
                    reason="PUBLISH_INCOMPLETE",
                )
            log.info("%s@%s waits for its home: %s", ref.registration_id, ref.version, waiting)
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 1.0)

    async def reconcile(self, rollout: Replica) -> None:
        """Give a (re)started or joining rollout the newest live versions of the
        registrations homed on it, then move its share of homes to it from the others (each
        moved registration's versions are pushed before its home changes, so its samples
        never meet a home without them)."""
        newest: dict[str, list[str]] = {}
        for parsed in await self.repo.live_ids(rollout.base_model):
            versions = newest.setdefault(parsed.registration_id, [])
            if len(versions) < self.resident_versions:
                versions.append(str(parsed))
        homes = await self.homes.repo.all(rollout.base_model)
        for rid, aids in newest.items():
            if homes.get(rid) == rollout.replica_id:
                await self._give(rollout, rid, aids)
        healthy = [
            r for r in await self.registry.replicas(ROLLOUT, rollout.base_model) if r.healthy
        ]
        homes = await self.homes.repo.all(rollout.base_model)
        moves = rebalance(homes, healthy)
        for rid, target in moves.items():
            if target != rollout.replica_id:
                continue
            if await self._give(rollout, rid, newest.get(rid, [])):
                await self.homes.repo.set(rollout.base_model, {rid: target})

    async def _give(self, rollout: Replica, rid: str, aids: list[str]) -> bool:
        """Push a registration's live versions (newest first in `aids`) to `rollout`; False
        when one failed (logged: the rollout's samples load what they need)."""
        reg = await self.registry.get_any(rid)
        if reg is not None and reg.state == RegState.RETIRED:
            return False
        ok = True
        for aid in reversed(aids):
            live = await self.repo.live(aid)
            if live is None:
                continue
            try:
                await self.pusher.load(rollout.address, live, await payload_of(live))
            except errors.LorafleetError as exc:
                log.warning("reconciling %s on %s failed: %s", aid, rollout.replica_id, exc)
                ok = False
        return ok

    async def _live(self, aid: str) -> tuple[str, Payload] | None:
        """The folder and files of a version recorded live, if it is."""
        live = await self.repo.live(aid)
        return None if live is None else (live.folder, await payload_of(live))

    async def forget(self, rid: str, base_model: str) -> None:
        """A retired registration's versions are no longer pushed to new rollouts. They stay
        recorded, so its samplers still serve (a rollout loads a version on demand); its
        newest stays held for its inflight samplers (version_gc.py)."""
        live = await self.repo.live_ids(base_model)
        await self.repo.unlist(base_model, [a for a in live if a.registration_id == rid])
        await self.homes.repo.forget(base_model, rid)


def _require_bound(reg: RegRecord, claim: Claim) -> None:
    """Export only a slot that holds the run's whole state: READY where the claim was sent
    (while BINDING a restore may be between its fresh bind and its replay). A lease reason,
    so the scheduler asks again once the run holds a slot."""
    if reg.state != RegState.READY or (reg.replica, reg.slot) != (claim.replica, claim.slot):
        raise errors.FailedPrecondition(
            f"{claim.registration_id} does not hold {claim.replica} slot {claim.slot} "
            f"(state {reg.state})",
            field="registration_id",
            reason="LEASE_MISMATCH",
        )


def _shared_folder(root: Path, refs: dict[str, common_pb2.BlobRef]) -> str:
    """Blocking: the version's folder the trainer wrote; it must lie inside this controller's
    shared root (a trainer mounting other storage is refused, by name)."""
    if not refs:
        raise errors.Unavailable("the trainer wrote no adapter files")
    described = {n: FileRef(r.uri, r.sha256, r.size_bytes) for n, r in refs.items()}
    return str(common_folder(root, described, "trainer adapter files"))


def _bytes_writer(files: dict[str, bytes]) -> Callable[[Path], None]:
    """A `fill` for _write: the trainer's exported files, as they are."""

    def fill(folder: Path) -> None:
        for name, data in files.items():
            (folder / Path(name).name).write_bytes(data)

    return fill


def _write_shared(
    root: Path, rid: str, version: int, fill: Callable[[Path], None]
) -> tuple[str, dict[str, common_pb2.BlobRef]]:
    """Blocking: a version's files written once on shared storage by `fill`, as the trainer
    does; its folder and the files' references."""
    final = adapter_folder(root, rid, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = final.with_name(f".tmp-{version}-{uuid.uuid4().hex}")
    try:
        staged.mkdir()
        fill(staged)
        described = publish_folder(staged, final)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    refs = {
        name: common_pb2.BlobRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)
        for name, r in described.items()
    }
    return str(final), refs
