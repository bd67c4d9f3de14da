"""Each run's replay log in Redis (recovery.py): the payloads of the operations that changed
its weights since its last snapshot, and that snapshot.

The log is one hash per run (`replay:<rid>`): a field per logged seq_id holding
`<previous seq_id>:<payload>` ('' before the first), and `snap_seq`/`snap` for the newest
snapshot; the registration keeps the newest logged seq_id (`replay_last`), the witness that
a log existed at all. Appending (`recovery_log`) and recording a snapshot
(`recovery_snapshot`) are scripts: the first writes the log and the registration together,
the second drops the entries the snapshot covers, each only when it is newer. Fencing:
logging is the leader's (its scheduler logs what the trainers applied), so it carries the
leader's epoch and is refused once a newer leader took over. A snapshot comes from the
leader's scheduler or from a page-out, which any replica may serve (PageOutRegistration):
it carries this controller's epoch when it has one, as `page_begin`/`page_end` do.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.v1 import trainer_pb2
from lorafleet_controller.store import Store, blob, named, text


@dataclass(frozen=True)
class LogEntry:
    """One logged operation: the seq_id logged before it (None for the first) and its
    OperationPayload bytes."""

    prev: int | None
    payload: bytes


@dataclass(frozen=True)
class ReplayLog:
    """What Redis holds to rebuild a run."""

    snapshot: trainer_pb2.SlotSnapshot | None
    snapshot_seq: int  # -1 without a snapshot
    last: int | None  # the newest logged seq_id, None when nothing was ever logged
    optim_steps: int  # optimizer steps the run applied (registration)
    entries: dict[int, LogEntry]


class RecoveryLog:
    """Every Redis access of the replay logs (and of a run's `corrupted` mark)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def append(self, rid: str, seq: int, payload: bytes, loaded: str = "") -> bool:
        """Log an applied operation (idempotent; ignored when a snapshot covers it);
        `loaded`: the checkpoint a load_state read, held on disk while the entry lasts."""
        out = named(
            await self.store.scripts.run(
                "recovery_log",
                [self.keys.replay(rid), self.keys.reg(rid)],
                rid,
                seq,
                payload,
                loaded,
                epoch=self.store.leader_epoch(),
                group=self.keys.group_of(rid),
            )
        )
        return text(out["code"]) == "logged"

    async def record_snapshot(self, rid: str, seq: int, snapshot: trainer_pb2.SlotSnapshot) -> bool:
        """Record a snapshot of the run after seq_id `seq` unless an as new one is recorded;
        the entries it covers are dropped."""
        out = named(
            await self.store.scripts.run(
                "recovery_snapshot",
                [self.keys.replay(rid)],
                rid,
                seq,
                snapshot.SerializeToString(deterministic=True),
                epoch=self.store.epoch,
                group=self.keys.group_of(rid),
            )
        )
        return text(out["code"]) == "recorded"

    async def load(self, rid: str) -> ReplayLog:
        """The log and the registration's newest seq_id, read in one step (recovery_load)."""
        flat, (last, steps) = await self.store.scripts.run(
            "recovery_load",
            [self.keys.replay(rid), self.keys.reg(rid)],
            rid,
            group=self.keys.group_of(rid),
        )
        raw = {text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
        entries = {}
        for name, value in raw.items():
            if name.isdigit():
                prev, _, payload = blob(value).partition(b":")
                entries[int(name)] = LogEntry(int(prev) if prev else None, payload)
        snap = raw.get("snap")
        return ReplayLog(
            snapshot=None if snap is None else trainer_pb2.SlotSnapshot.FromString(blob(snap)),
            snapshot_seq=int(raw.get("snap_seq", b"-1")),
            last=None if last is None else int(last),
            optim_steps=int(steps or 0),
            entries=entries,
        )

    async def loaded(self, rid: str) -> set[str]:
        """The checkpoints the run's log loaded since its snapshot: a replay reads them."""
        return {
            text(path)
            async for _, path in self.store.redis.hscan_iter(self.keys.replay(rid), "load:*")
        }

    async def loaded_by_any(self) -> set[str]:
        """The checkpoints any run's log loaded since its snapshot (one HSCAN per run: the
        log's payloads stay on the server)."""
        held: set[str] = set()
        async for rid in self.store.redis.sscan_iter(self.keys.regs):
            held |= await self.loaded(text(rid))
        return held

    async def snapshot(self, rid: str) -> trainer_pb2.SlotSnapshot | None:
        """The snapshot the run's log points to, if any."""
        raw = await self.store.redis.hget(self.keys.replay(rid), "snap")
        return None if raw is None else trainer_pb2.SlotSnapshot.FromString(blob(raw))

    async def mark_corrupted(self, rid: str, message: str) -> None:
        """Say on the registration why the run cannot be rebuilt (`lorafleet status`)."""
        await self.store.redis.hset(self.keys.reg(rid), "corrupted", message)

    async def drop(self, rid: str) -> None:
        """Forget a retired run's log."""
        await self.store.redis.delete(self.keys.replay(rid))
