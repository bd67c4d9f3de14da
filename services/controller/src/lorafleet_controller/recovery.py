"""Exactly-once through trainer loss: rebuild a run from its last snapshot by replay.

A trainer holds a run's weights only in memory. To rebuild a run whose trainer was lost,
the controller keeps, per run, the payloads of the operations that changed its weights
since its last snapshot (`log`: forward_backward, optim_step, load_state; forward, save and
publish change nothing) and the newest snapshot its trainer reported (`record_snapshot`,
see the trainer's snapshots.py). `restore` rebuilds the run on a freshly bound slot: it
loads that snapshot (or keeps the bind's initial weights, a pure function of the LoRA seed,
when there is none) and re-applies the logged operations in seq_id order under their
original operation ids, so the new trainer's dedup knows them: a re-dispatch of the
operation that was in flight at the loss answers with its replayed result instead of
applying it twice. Restoring always starts from a fresh bind, so an interrupted restore
is simply done again.

An entry is logged after the trainer applied the operation and before the ledger records
its outcome, so the log holds every operation ever reported applied (a controller killed in
between re-dispatches it under the same id, gets the first result, and logs it once). Each
entry names the one before it, and the registration keeps the newest one's seq_id, so a
missing link (a payload expired or deleted, the log lost with Redis) is detected instead of
silently replaying a shorter history; so is a snapshot or loaded checkpoint that is gone.
A checkpoint a logged load_state read is named in the log (`load:<seq_id>`), so deleting it
or its expiry removes its record but not its files while the entry lasts (reclaim.py), and
the replay finds its manifest in the reclaim queue.
Then the run is corrupted: its open operations fail, its slot is freed, every later call
fails with an error that names what was lost, and the registration's `corrupted` field says
it for `lorafleet status`. Never a silent rollback.

Replay is bit-identical to the uninterrupted run on CPU: initial weights and dropout masks
are seeded (LoRA seed, optimizer step, datum ordinal), the kernels are deterministic, the
optimizer moments and step count come back exactly from the snapshot, and each replayed
forward_backward runs as its own pass, as it did when its run was alone on the trainer. A
pass the run originally shared with other runs' items had another padded width and row
count, which may change the last bits on some BLAS paths. On GPU, replay is exact only with
deterministic algorithms (`torch.use_deterministic_algorithms`, `CUBLAS_WORKSPACE_CONFIG`)
and the same batch shapes; otherwise it reproduces the run to floating-point tolerance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet import errors
from lorafleet.rpc.errors import exception_from_info
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2
from lorafleet_controller import validate
from lorafleet_controller.store import Store
from lorafleet_controller.store.recovery_log import RecoveryLog

log = logging.getLogger(__name__)

K = controller_pb2
# Kinds whose effect on the weights must be replayed (forward, save, publish change nothing).
LOGGED_KINDS = frozenset(
    {K.OPERATION_KIND_FORWARD_BACKWARD, K.OPERATION_KIND_OPTIM_STEP, K.OPERATION_KIND_LOAD_STATE}
)

ManifestFor = Callable[[str], Awaitable[common_pb2.BlobRef | None]]
Retire = Callable[[str, errors.LorafleetError], Awaitable[None]]
TrainerFor = Callable[[str], Awaitable[Any]]  # a run id -> a client of a healthy trainer, or None


class Corrupted(Exception):
    """The run cannot be rebuilt; the message says what was lost."""


@dataclass(frozen=True)
class Plan:
    """What rebuilds a run: its snapshot (if any) and the operations after it, in order."""

    snapshot: trainer_pb2.SlotSnapshot | None
    snapshot_seq: int
    ops: list[tuple[int, bytes]]
    """(seq_id, serialized OperationPayload) to replay, oldest first."""


def loaded_path(body: bytes) -> str:
    """The checkpoint a load_state payload reads ('' for any other kind)."""
    if validate.wire_kind(body) != controller_pb2.OPERATION_KIND_LOAD_STATE:
        return ""
    return controller_pb2.OperationPayload.FromString(body).load_state.path


def seq_of(registration_id: str, operation_id: str) -> int | None:
    """The seq_id of `<registration_id>#<seq>`; None for any other id."""
    rid, _, seq = operation_id.rpartition("#")
    return int(seq) if rid == registration_id and seq.isdigit() else None


class Recovery:
    """The replay log of every run, and restoring a run from it on a new slot."""

    def __init__(
        self,
        store: Store,
        manifest_for: ManifestFor,
        retire: Retire,
        trainer_for: TrainerFor | None = None,
    ) -> None:
        self.replay_log = RecoveryLog(store)  # fenced by the leader epoch (see there)
        self.manifest_for = manifest_for
        self.retire = retire
        self.trainer_for = trainer_for
        self._pruning: set[asyncio.Task[None]] = set()  # retired runs' prunes in flight

    # --- dispatch side --------------------------------------------------------------------
    async def log(self, applied: Sequence[tuple[str, int, int, bytes]]) -> None:
        """Keep the payloads of operations the trainer just applied: (rid, seq, kind, payload).

        Call before recording their outcomes; kinds that change no weights are skipped.
        """
        by_run: dict[str, list[tuple[int, bytes]]] = {}
        for rid, seq, kind, body in sorted(applied, key=lambda a: a[1]):
            if kind in LOGGED_KINDS:
                by_run.setdefault(rid, []).append((seq, body))
        await asyncio.gather(*(self._log_run(rid, entries) for rid, entries in by_run.items()))

    async def _log_run(self, rid: str, entries: list[tuple[int, bytes]]) -> None:
        """One run's entries in seq_id order: each names the one before it."""
        for seq, body in entries:
            await self.replay_log.append(rid, seq, body, loaded_path(body))

    async def record_snapshot(self, rid: str, snapshot: trainer_pb2.SlotSnapshot) -> None:
        """Record the trainer's newest complete snapshot of a run (from an OptimStep answer)."""
        seq = seq_of(rid, snapshot.operation_id)
        if seq is None or not snapshot.manifest.uri:
            return
        await self.record_page(rid, seq, snapshot.manifest)

    async def record_page(self, rid: str, seq: int, manifest: common_pb2.BlobRef) -> None:
        """Record a snapshot of the run's exact state after seq_id `seq` (an automatic one, or
        a page-out's: paging.py); ignored unless newer than the one recorded."""
        snapshot = trainer_pb2.SlotSnapshot(operation_id=f"{rid}#{seq}", manifest=manifest)
        await self.replay_log.record_snapshot(rid, seq, snapshot)

    # --- restoring ------------------------------------------------------------------------
    async def plan(self, rid: str) -> Plan:
        """The snapshot and operations that rebuild `rid`; Corrupted when a link is missing."""
        history = await self.replay_log.load(rid)
        snapshot, snap_seq = history.snapshot, history.snapshot_seq
        steps = history.optim_steps
        if history.last is None and snapshot is None and steps > 0:
            raise Corrupted(f"its replay log is gone although {steps} optimizer steps were applied")
        ops: list[tuple[int, bytes]] = []
        cursor = history.last
        while cursor is not None and cursor > snap_seq:
            entry = history.entries.get(cursor)
            if entry is None:
                after = f"its last snapshot (seq_id {snap_seq})" if snapshot else "its start"
                raise Corrupted(
                    f"the payload of seq_id {cursor} is gone (expired or deleted), so the "
                    f"operations since {after} cannot be replayed"
                )
            ops.append((cursor, entry.payload))
            cursor = entry.prev
        ops.reverse()
        return Plan(snapshot, snap_seq, ops)

    async def restore(self, trainer: Any, rec: Any, replica_id: str, incarnation: str) -> bool:
        """Rebuild `rec` (a placed RegRecord) in its slot on `trainer`; False when corrupted.

        Transport and lease failures propagate (the placement is retried, from scratch);
        anything that makes the history unrecoverable corrupts the run.
        """
        rid, slot = rec.registration_id, rec.slot
        try:
            plan = await self.plan(rid)
            await trainer.unbind(slot, rid)  # a fresh bind: restoring is a pure function
            await trainer.bind(slot, rid, rec.lora)
            if plan.snapshot is not None:
                opid = f"{rid}#restore@{replica_id}:{incarnation}"
                await _or_corrupted(
                    trainer.load_state(
                        opid, slot, rid, plan.snapshot.manifest, True, incarnation=incarnation
                    ),
                    f"its last snapshot (seq_id {plan.snapshot_seq}) no longer loads",
                )
            for seq, body in plan.ops:
                await self._apply(trainer, incarnation, rid, slot, seq, body)
        except Corrupted as exc:
            await self.corrupt(rid, str(exc))
            return False
        log.info(
            "restored %s on %s slot %d: snapshot seq_id %s + %d replayed operations",
            rid,
            replica_id,
            slot,
            plan.snapshot_seq if plan.snapshot else "-",
            len(plan.ops),
        )
        return True

    async def _apply(
        self,
        trainer: Any,
        incarnation: str,
        rid: str,
        slot: int,
        seq: int,
        body: bytes,
    ) -> None:
        """Apply one logged operation again; a forward_backward's bytes go to the trainer as
        they were logged, a control payload is parsed to act on it."""
        opid = f"{rid}#{seq}"
        if validate.wire_kind(body) == controller_pb2.OPERATION_KIND_FORWARD_BACKWARD:
            item = trainer_pb2.ForwardBackwardItem(
                operation_id=opid, slot=slot, registration_id=rid, payload=body
            )
            resp = await trainer.forward_backward([item], incarnation=incarnation)
            result = resp.results[0]
            if result.WhichOneof("outcome") != "result":
                lost = f"replaying seq_id {seq} (forward_backward) failed"
                _corrupted_unless_retryable(exception_from_info(result.error), lost)
            return
        payload = controller_pb2.OperationPayload.FromString(body)
        which = payload.WhichOneof("kind")
        lost = f"replaying seq_id {seq} ({which}) failed"
        if which == "optim_step":
            await _or_corrupted(
                trainer.optim_step(opid, slot, rid, payload.optim_step, incarnation=incarnation),
                lost,
            )
        elif which == "load_state":
            manifest = await self.manifest_for(payload.load_state.path)
            if manifest is None:
                raise Corrupted(
                    f"the checkpoint {payload.load_state.path} it loaded at seq_id {seq} is gone"
                )
            await _or_corrupted(
                trainer.load_state(
                    opid,
                    slot,
                    rid,
                    manifest,
                    payload.load_state.with_optimizer,
                    incarnation=incarnation,
                ),
                lost,
            )
        else:
            raise Corrupted(f"{lost}: {which} is not replayable")

    async def corrupt(self, rid: str, what: str) -> None:
        """Fence a run that cannot be rebuilt; every later call gets this error."""
        message = (
            f"training run {rid} lost its trainer and cannot be rebuilt: {what}. Its weights "
            "are lost; continue from a saved state in a new run"
        )
        log.error("%s", message)
        await self.replay_log.mark_corrupted(rid, message)
        await self.retire(
            rid,
            errors.FailedPrecondition(message, field="registration_id", reason="RUN_CORRUPTED"),
        )

    async def forget(self, rid: str) -> None:
        """Drop a retired run's log, and have its snapshots and page-out saves deleted in the
        background (a stopped trainer must not hold up a session's finish). Its checkpoints
        (what the user saved) stay; so do the folders when no trainer is healthy now or the
        controller stops first."""
        await self.replay_log.drop(rid)
        task = asyncio.create_task(self._prune_retired(rid))
        self._pruning.add(task)
        task.add_done_callback(self._pruning.discard)

    async def _prune_retired(self, rid: str) -> None:
        try:
            trainer = await self.trainer_for(rid) if self.trainer_for else None
            if trainer is not None:
                await self.prune(trainer, rid, keep=False)
        except Exception:
            log.exception("pruning the snapshots of the retired run %s failed", rid)

    # --- disk -----------------------------------------------------------------------------
    async def prune(self, trainer: Any, rid: str, *, keep: bool = True) -> None:
        """Have the trainer delete the run's snapshots and page-out saves that the log no
        longer points to (PruneSnapshots). Call only while the run cannot record a newer
        snapshot (a page-out's PAGING window, or retired), so the pointer read here stays the
        log's while the trainer prunes. `keep=False`: the run is retired, nothing is kept.
        Best effort: what a failed prune leaves is deleted by the next one."""
        uri = await self.snapshot_uri(rid) if keep else None
        try:
            removed = await trainer.prune_snapshots(rid, [uri] if uri else [])
        except errors.LorafleetError as exc:
            log.warning("pruning the snapshots of %s failed (%s); the next retries", rid, exc)
            return
        if removed:
            log.info("pruned %d superseded snapshots of %s", len(removed), rid)

    async def snapshot_uri(self, rid: str) -> str | None:
        """The folder (file:// URI) of the snapshot the run's log points to, if any."""
        snapshot = await self.replay_log.snapshot(rid)
        return None if snapshot is None else snapshot.manifest.uri or None


_LEASE_REASONS = frozenset({"SLOT_UNBOUND", "LEASE_MISMATCH", "STALE_INCARNATION"})


async def _or_corrupted(call: Awaitable[Any], lost: str) -> Any:
    try:
        return await call
    except errors.LorafleetError as exc:
        _corrupted_unless_retryable(exc, lost)


def _corrupted_unless_retryable(exc: errors.LorafleetError, lost: str) -> None:
    """A trainer refusing the replayed history itself means corruption; transport and lease
    failures are raised as they are, so the placement is retried."""
    if isinstance(exc, errors.Unavailable) or exc.reason in _LEASE_REASONS:
        raise exc
    raise Corrupted(f"{lost}: {exc.message}") from None
