"""The publish barrier: save_weights_for_sampler completes only when every rollout has it.

Steps of one publish (each idempotent, so a re-dispatch after a controller crash is safe):
the version number is allocated once and stored on the operation; the trainer streams the
slot's PEFT adapter (ExportAdapter); the files are written once under the storage root
(they are the durable sampler checkpoint and the source for reconciling rollouts); every
healthy rollout replica serving the base model receives them (LoadAdapter, verified by
SHA-256) under `<registration>@<version>`; only when all acknowledged does the operation
succeed and the registration's published_version move. A replica that is restarting is waited
for (`push_all`); one that refuses the version fails the operation with its name. Rollouts
that (re)start are reconciled: they receive the newest live versions of every registration
of their base model.

Where every replica mounts the same storage (`shared_adapter_root`, lorafleet.shared_storage)
the adapter travels by reference instead: the trainer writes the version's folder there
(WriteSharedAdapter) and each rollout gets a header with every file's URI and SHA-256 and
reads the files itself, so no adapter bytes pass through the controller's memory. The
folder is then the durable sampler checkpoint. Without it, today's streamed push.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from lorafleet import errors
from lorafleet.contract import AdapterId, CheckpointKind, TinkerPath
from lorafleet.shared_storage import FileRef, adapter_folder, common_folder, publish_folder
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller import metrics
from lorafleet_controller.catalog import SAMPLER, Catalog, CheckpointRecord
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.ledger import Claim
from lorafleet_controller.registry import ROLLOUT, Registry, RegRecord, Replica
from lorafleet_controller.residency import Payload, Pusher, payload_of
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
    ) -> None:
        self.repo = AdaptersRepo(store)
        self.pusher = Pusher(self.repo, pool)
        self.storage_root = storage_root
        self.registry = registry
        self.catalog = catalog
        self.samplers = samplers
        self.pool = pool
        self.resident_versions = resident_versions
        self.shared_root = shared_root
        self.rollout_wait_seconds = rollout_wait_seconds

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
            folder = await asyncio.to_thread(self._write, claim.registration_id, version, files)
            payload = Payload(files=files)
        if live is None:
            record = LiveVersion(ref, reg.base_model, reg.lora, folder, payload.refs)
            await self.repo.record_live(record, fenced=True)
        await self.push_all(ref, reg.base_model, reg.lora, payload)
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

    def _write(self, rid: str, version: int, files: dict[str, bytes]) -> str:
        """Blocking: write a version's files once under the storage root (worker thread)."""
        folder = self.storage_root / "adapters" / rid / str(version)
        if folder.is_dir():
            return str(folder)
        tmp = folder.with_name(f"{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, data in files.items():
            (tmp / Path(name).name).write_bytes(data)
        tmp.rename(folder)
        return str(folder)

    async def sampler_from_checkpoint(
        self, ckpt: CheckpointRecord, sampler_id: str, tenant: str, model_path: str
    ) -> SamplerRecord:
        """A sampler on a training checkpoint: its adapter becomes a new live version of the
        run (written once, pushed to every rollout) and the sampler pins that version. On
        shared storage the controller writes it there once and rollouts read it by reference
        (its bytes pass through here once, not once per rollout)."""
        files = await self.catalog.read_files(ckpt)
        version = await self.repo.allocate_version(ckpt.training_run_id, "", fenced=False)
        ref = common_pb2.AdapterRef(registration_id=ckpt.training_run_id, version=version)
        if self.shared_root is not None:
            folder, payload = await asyncio.to_thread(
                _write_shared, self.shared_root, ckpt.training_run_id, version, files
            )
        else:
            folder = await asyncio.to_thread(self._write, ckpt.training_run_id, version, files)
            payload = Payload(files=files)
        record = LiveVersion(ref, ckpt.base_model, ckpt.lora, folder, payload.refs)
        await self.repo.record_live(record, fenced=False)
        await self.push_all(ref, ckpt.base_model, ckpt.lora, payload)
        return await self.samplers.record(
            sampler_id=sampler_id,
            tenant=tenant,
            base_model=ckpt.base_model,
            model_path=model_path,
            ref=ref,
            inflight=False,
        )

    async def push_all(
        self,
        ref: common_pb2.AdapterRef,
        base_model: str,
        lora: common_pb2.LoraConfig,
        payload: Payload,
    ) -> None:
        """Load the version on every healthy rollout of the base model; all must ack.

        The barrier is over the rollouts as the replica table stands, read again on every
        pass, because a rollout restarting under the supervisor (or rescheduled at another
        address) is the normal case, not a failure the SDK could retry: the publish's seq_id
        is spent once it fails (CAMPAIGN_FAULTS=500 failed save_weights_for_sampler on a
        rollout's refused connection). So a push refused as Unavailable is tried again, with
        backoff, for `rollout_wait_seconds` from the first refusal, at the address the
        replica announces now. A rollout the controller has meanwhile lost (silent past its
        heartbeat, or failed for good) leaves the barrier: the version was recorded live
        before this push, so `reconcile` gives it to the rollout when it returns, and a
        sample that meets it without the version puts it back. An ack counts for the
        incarnation that gave it; a restarted rollout is pushed again. Any other refusal
        (a checksum, a rank the rollout cannot serve) fails the publish at once, naming the
        replica."""
        loop = asyncio.get_running_loop()
        acked: set[tuple[str, str]] = set()
        deadline: float | None = None
        delay = 0.05
        while True:
            rollouts = [
                r
                for r in await self.registry.replicas(ROLLOUT, base_model)
                if r.healthy and (r.replica_id, r.incarnation) not in acked
            ]
            if not rollouts:
                return
            outcomes = await asyncio.gather(
                *(self.pusher.load(r.address, ref, lora, payload, retry=False) for r in rollouts),
                return_exceptions=True,
            )
            waiting: list[str] = []
            refused: list[str] = []
            for rep, out in zip(rollouts, outcomes, strict=True):
                if not isinstance(out, BaseException):
                    acked.add((rep.replica_id, rep.incarnation))
                elif isinstance(out, errors.Unavailable):
                    waiting.append(f"{rep.replica_id} ({out})")
                else:
                    refused.append(f"{rep.replica_id} ({out})")
            if not refused and not waiting:
                continue  # every one acked: read the table again for any that came up since
            now = loop.time()
            deadline = now + self.rollout_wait_seconds if deadline is None else deadline
            if refused or now >= deadline:
                raise errors.Unavailable(
                    f"rollout replicas did not acknowledge {ref.registration_id}@{ref.version}: "
                    + "; ".join(refused + waiting),
                    reason="PUBLISH_INCOMPLETE",
                )
            log.info(
                "%s@%s waits for rollouts: %s", ref.registration_id, ref.version, "; ".join(waiting)
            )
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 1.0)

    async def reconcile(self, rollout: Replica) -> None:
        """Give a (re)started rollout the newest live versions of every registration."""
        newest: dict[str, list[str]] = {}
        for parsed in await self.repo.live_ids(rollout.base_model):
            versions = newest.setdefault(parsed.registration_id, [])
            if len(versions) < self.resident_versions:
                versions.append(str(parsed))
        for rid, aids in newest.items():
            reg = await self.registry.get_any(rid)
            if reg is not None and reg.state == RegState.RETIRED:
                continue
            for aid in reversed(aids):
                live = await self.repo.live(aid)
                if live is None:
                    continue
                payload = await payload_of(live)
                ref = common_pb2.AdapterRef(registration_id=rid, version=live.ref.version)
                try:
                    await self.pusher.load(rollout.address, ref, live.lora, payload)
                except errors.LorafleetError as exc:
                    log.warning("reconciling %s on %s failed: %s", aid, rollout.replica_id, exc)

    async def _live(self, aid: str) -> tuple[str, Payload] | None:
        """The folder and files of a version recorded live, if it is."""
        live = await self.repo.live(aid)
        return None if live is None else (live.folder, await payload_of(live))

    async def forget(self, rid: str, base_model: str) -> None:
        """A retired registration's versions are no longer pushed to new rollouts."""
        live = await self.repo.live_ids(base_model)
        await self.repo.unlist(base_model, [a for a in live if a.registration_id == rid])


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


def _write_shared(
    root: Path, rid: str, version: int, files: dict[str, bytes]
) -> tuple[str, Payload]:
    """Blocking: a version's files written once on shared storage, as the trainer does."""
    final = adapter_folder(root, rid, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = final.with_name(f".tmp-{version}-{uuid.uuid4().hex}")
    try:
        staged.mkdir()
        for name, data in files.items():
            (staged / Path(name).name).write_bytes(data)
        described = publish_folder(staged, final)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    refs = {
        name: common_pb2.BlobRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)
        for name, r in described.items()
    }
    return str(final), Payload(refs=refs)
