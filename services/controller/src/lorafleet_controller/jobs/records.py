"""Job records in Redis: what a job is, where it stands and how it ended.

One hash per job (`keys.job`): owner tenant, run, kind, parameters and data (JSON), state,
the cursor of its last pass boundary, progress, result, error and a version that grows with
every write. Indexes: the tenant's jobs by creation time, each run's unfinished jobs in the
order they run (one job at a time per run, since they share its seq_ids), and the set of
unfinished jobs a new leader resumes. Every change is one MULTI/EXEC, then the job id is
published on the ledger's `done` channel (after the transaction: a Cluster pipeline may not
publish), which wakes long-polling GetJob calls through the same `Notifier` as operations;
a lost wake-up only delays a poll until its timeout re-reads the record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lorafleet import errors
from lorafleet_controller.notify import Notifier
from lorafleet_controller.store import Store, text


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


def _json(raw: bytes | str | None) -> Any:
    return json.loads(raw) if raw else None


class Records:
    def __init__(
        self, store: Store, notifier: Notifier, clock: Callable[[], float] = time.time
    ) -> None:
        self.redis = store.redis
        self.keys = store.keys
        self.notifier = notifier
        self.clock = clock

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
    ) -> JobRecord:
        now = self.clock()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.keys.job(job_id),
                mapping={
                    "tenant": tenant,
                    "kind": kind,
                    "rid": rid,
                    "base_model": base_model,
                    "state": JobState.QUEUED.value,
                    "params": json.dumps(params),
                    "data": json.dumps(data),
                    "max_updates": max_updates,
                    "created_at": now,
                    "version": 1,
                },
            )
            pipe.zadd(self.keys.tenant_jobs(tenant), {job_id: now})
            pipe.rpush(self.keys.run_jobs(rid), job_id)
            pipe.sadd(self.keys.jobs_open, job_id)
            await pipe.execute()
        await self.redis.publish(self.keys.done, job_id)
        return await self.get_any(job_id)

    async def get_any(self, job_id: str) -> JobRecord:
        raw = await self.redis.hgetall(self.keys.job(job_id))
        if not raw:
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")
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
            max_updates=int(raw.get(b"max_updates", b"0")),
            cancel_requested=raw.get(b"cancel") == b"1",
            created_at=float(raw.get(b"created_at", b"0")),
            started_at=float(raw.get(b"started_at", b"0")),
            finished_at=float(raw.get(b"finished_at", b"0")),
            version=int(raw.get(b"version", b"0")),
        )

    async def get(self, tenant: str, job_id: str) -> JobRecord:
        rec = await self.get_any(job_id)
        if rec.tenant != tenant:
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")
        return rec

    async def wait(self, tenant: str, job_id: str, after: int, seconds: float) -> JobRecord:
        """The job once its version is past `after` or it has finished, or after `seconds`."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            with self.notifier.watch(job_id) as event:
                rec = await self.get(tenant, job_id)
                remaining = deadline - time.monotonic()
                if rec.version > after or rec.finished or remaining <= 0:
                    return rec
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    return await self.get(tenant, job_id)

    async def list_jobs(self, tenant: str, limit: int, offset: int) -> tuple[list[JobRecord], int]:
        key = self.keys.tenant_jobs(tenant)
        ids = await self.redis.zrevrange(key, offset, offset + limit - 1)
        total = int(await self.redis.zcard(key))
        return [await self.get_any(text(i)) for i in ids], total

    async def update(self, job_id: str, **fields: Any) -> None:
        """Write fields (dicts as JSON), bump the version and wake watchers."""
        mapping: dict[Any, Any] = {
            k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in fields.items()
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(job_id), mapping=mapping)
            pipe.hincrby(self.keys.job(job_id), "version", 1)
            await pipe.execute()
        await self.redis.publish(self.keys.done, job_id)

    async def finish(self, rec: JobRecord, state: JobState, **fields: Any) -> None:
        """End a job: its state, its last fields, and out of the run's queue."""
        mapping: dict[Any, Any] = {
            k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in fields.items()
        }
        mapping.update(state=state.value, finished_at=self.clock(), live="[]")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(rec.job_id), mapping=mapping)
            pipe.hincrby(self.keys.job(rec.job_id), "version", 1)
            pipe.lrem(self.keys.run_jobs(rec.registration_id), 0, rec.job_id)
            pipe.srem(self.keys.jobs_open, rec.job_id)
            await pipe.execute()
        await self.redis.publish(self.keys.done, rec.job_id)

    async def request_cancel(self, job_id: str) -> None:
        await self.update(job_id, cancel="1")

    async def cancel_requested(self, job_id: str) -> bool:
        return await self.redis.hget(self.keys.job(job_id), "cancel") == b"1"

    async def open_ids(self) -> list[str]:
        return sorted(text(i) for i in await self.redis.smembers(self.keys.jobs_open))

    async def run_queue(self, rid: str) -> list[str]:
        return [text(i) for i in await self.redis.lrange(self.keys.run_jobs(rid), 0, -1)]

    # --- default runs -------------------------------------------------------------------
    async def default_run(self, tenant: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.default_run(tenant))
        return {text(k): text(v) for k, v in raw.items()}

    async def set_default_run(self, tenant: str, **fields: str) -> None:
        mapping: dict[Any, Any] = fields
        await self.redis.hset(self.keys.default_run(tenant), mapping=mapping)

    async def clear_default_run(self, tenant: str) -> None:
        await self.redis.delete(self.keys.default_run(tenant))
