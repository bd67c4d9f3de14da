"""Managed jobs' records in Redis: every read and write of the job family.

One hash per job (`keys.job`): owner tenant, run, kind, parameters and data (JSON), state,
the cursor of its last pass boundary, progress, result, error and a version that grows with
every write. Indexes: the tenant's jobs by creation time, each run's unfinished jobs in the
order they run (one job at a time per run, since they share its seq_ids), and the set of
unfinished jobs a new leader resumes. And per tenant, its default run for jobs.

Every write that changes a job is one script (`store/lua/job_*.lua`) that also PUBLISHes
the job id on the ledger's `done` channel, which wakes long-polling GetJob calls through
the same `Notifier` as operations; a lost wake-up only delays a poll until its timeout
re-reads the record.

Fencing: the leader's runner moves jobs along (`update` with its epoch, `finish`,
`set_default_checkpoint`), so those take `epoch=store.leader_epoch()` and a deposed leader's
write is refused (`StaleEpoch`) instead of failing or rewinding a job the new leader resumed.
What any replica serves for a request is not fenced: `create`, a cancel request (`update`
with `epoch=None`), and setting or clearing a tenant's default run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lorafleet_controller.store import Store, named, text


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    tenant: str
    kind: str
    registration_id: str
    base_model: str
    state: JobState
    params: dict[str, str]
    data: dict[str, Any]
    cursor: dict[str, Any] | None
    live: list[dict[str, Any]]  # curve points of the pass in progress
    result: dict[str, Any] | None
    error: dict[str, str] | None
    max_updates: int
    cancel_requested: bool
    created_at: float
    started_at: float
    finished_at: float
    version: int

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


# Fields a job's writes may set after its creation (the runner's progress, its end, a
# cancel request); anything else is a caller's bug, refused before Redis is touched.
MUTABLE = frozenset({"state", "started_at", "cursor", "live", "result", "error", "cancel"})


def _json(raw: object) -> Any:
    return json.loads(raw) if isinstance(raw, bytes | str) and raw else None


def _pairs(fields: Mapping[str, Any]) -> list[Any]:
    """(field, value) pairs for a script, dicts and lists as JSON; unknown fields refused."""
    unknown = sorted(set(fields) - MUTABLE)
    if unknown:
        raise ValueError(f"not a writable job field: {', '.join(unknown)}")
    out: list[Any] = []
    for name, value in fields.items():
        out += [name, json.dumps(value) if isinstance(value, dict | list) else value]
    return out


class JobsRepo:
    """The job family's store (see the module doc for what is fenced)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def create(
        self,
        job_id: str,
        tenant: str,
        kind: str,
        rid: str,
        base_model: str,
        params: dict[str, str],
        data: dict[str, Any],
        max_updates: int,
        created_at: float,
    ) -> None:
        """Record a QUEUED job and queue it on its run; a replayed id changes nothing."""
        own = [self.keys.job(job_id), self.keys.tenant_jobs(tenant), self.keys.run_jobs(rid)]
        await self.store.scripts.run(
            "job_create",
            own,
            job_id,
            tenant,
            rid,
            created_at,
            "kind",
            kind,
            "base_model",
            base_model,
            "state",
            JobState.QUEUED.value,
            "params",
            json.dumps(params),
            "data",
            json.dumps(data),
            "max_updates",
            max_updates,
        )

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.store.redis.hgetall(self.keys.job(job_id))
        if not raw:
            return None
        return JobRecord(
            job_id=job_id,
            tenant=text(raw.get(b"tenant")),
            kind=text(raw.get(b"kind")),
            registration_id=text(raw.get(b"rid")),
            base_model=text(raw.get(b"base_model")),
            state=JobState(text(raw.get(b"state"))),
            params=_json(raw.get(b"params")) or {},
            data=_json(raw.get(b"data")) or {},
            cursor=_json(raw.get(b"cursor")),
            live=_json(raw.get(b"live")) or [],
            result=_json(raw.get(b"result")),
            error=_json(raw.get(b"error")),
            max_updates=int(text(raw.get(b"max_updates"), "0")),
            cancel_requested=raw.get(b"cancel") == b"1",
            created_at=float(text(raw.get(b"created_at"), "0")),
            started_at=float(text(raw.get(b"started_at"), "0")),
            finished_at=float(text(raw.get(b"finished_at"), "0")),
            version=int(text(raw.get(b"version"), "0")),
        )

    async def tenant_page(self, tenant: str, limit: int, offset: int) -> tuple[list[str], int]:
        """A page of the tenant's job ids, newest first, and how many it has in all."""
        key = self.keys.tenant_jobs(tenant)
        ids = await self.store.redis.zrevrange(key, offset, offset + limit - 1)
        return [text(i) for i in ids], int(await self.store.redis.zcard(key))

    async def update(self, job_id: str, fields: Mapping[str, Any], *, epoch: int | None) -> bool:
        """Write fields of a job and bump its version; False when there is no such job."""
        out = named(
            await self.store.scripts.run(
                "job_update", [self.keys.job(job_id)], job_id, *_pairs(fields), epoch=epoch
            )
        )
        return text(out["code"]) == "updated"

    async def finish(
        self,
        job_id: str,
        rid: str,
        state: JobState,
        fields: Mapping[str, Any],
        *,
        finished_at: float,
        epoch: int,
    ) -> None:
        """End a job in `state` with its last fields, out of its run's queue and the open set."""
        own = [self.keys.job(job_id), self.keys.run_jobs(rid)]
        await self.store.scripts.run(
            "job_finish",
            own,
            job_id,
            rid,
            state.value,
            finished_at,
            *_pairs(fields),
            epoch=epoch,
        )

    async def cancel_requested(self, job_id: str) -> bool:
        return await self.store.redis.hget(self.keys.job(job_id), "cancel") == b"1"

    async def open_ids(self) -> list[str]:
        """Unfinished jobs, the ones a new leader resumes."""
        return sorted(text(i) for i in await self.store.redis.smembers(self.keys.jobs_open))

    async def run_queue(self, rid: str) -> list[str]:
        """A run's unfinished jobs, in the order they run."""
        return [text(i) for i in await self.store.redis.lrange(self.keys.run_jobs(rid), 0, -1)]

    async def drop_from_run(self, rid: str, job_id: str) -> None:
        """Take a job whose record is gone out of its run's queue (one command: no fence
        needed, a dangling id is dropped by whichever leader meets it)."""
        await self.store.redis.lrem(self.keys.run_jobs(rid), 0, job_id)

    # --- default runs -------------------------------------------------------------------
    async def default_run(self, tenant: str) -> dict[str, str]:
        """The tenant's default run for jobs: `rid` and `checkpoint` (empty when none)."""
        raw = await self.store.redis.hgetall(self.keys.default_run(tenant))
        return {text(k): text(v) for k, v in raw.items()}

    async def set_default_run(self, tenant: str, **fields: str) -> None:
        mapping: dict[Any, Any] = fields
        await self.store.redis.hset(self.keys.default_run(tenant), mapping=mapping)

    async def set_default_checkpoint(
        self, tenant: str, rid: str, checkpoint: str, *, epoch: int
    ) -> bool:
        """The state the next default run resumes, only while `rid` is still the tenant's
        default run (False otherwise: a reset meanwhile stays a reset)."""
        out = named(
            await self.store.scripts.run(
                "job_default_checkpoint",
                [self.keys.default_run(tenant)],
                tenant,
                rid,
                checkpoint,
                epoch=epoch,
            )
        )
        return text(out["code"]) == "set"

    async def clear_default_run(self, tenant: str) -> None:
        await self.store.redis.delete(self.keys.default_run(tenant))
