"""Job records for the runner and the job RPCs: what a job is, where it stands and how it ended.

The records themselves (their hash, indexes and scripts) are `store.jobs.JobsRepo`'s; this
module adds what is not storage: long-polling a job's next version through the `Notifier`,
tenant scoping (another tenant's job is NotFound), the clock, and which writes are fenced.
The runner's writes (`update`, `finish`, `set_default_checkpoint`) run on the leader and
carry its epoch, so a deposed leader's are refused (`StaleEpoch`); a job's creation, a cancel
request and a tenant's default run are written by whichever replica serves the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from lorafleet import errors
from lorafleet_controller.notify import Notifier
from lorafleet_controller.store import Store
from lorafleet_controller.store.jobs import JobRecord, JobsRepo, JobState

__all__ = ["JobRecord", "JobState", "Records"]


class Records:
    def __init__(
        self, store: Store, notifier: Notifier, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.repo = JobsRepo(store)
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
        self.store.room.admit("job")
        await self.repo.create(
            job_id, tenant, kind, rid, base_model, params, data, max_updates, self.clock()
        )
        return await self.get_any(job_id)

    async def get_any(self, job_id: str) -> JobRecord:
        rec = await self.repo.get(job_id)
        if rec is None:
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")
        return rec

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
                    async with asyncio.timeout(remaining):
                        await event.wait()
                except TimeoutError:
                    return await self.get(tenant, job_id)

    async def list_jobs(self, tenant: str, limit: int, offset: int) -> tuple[list[JobRecord], int]:
        ids, total = await self.repo.tenant_page(tenant, limit, offset)
        return [await self.get_any(i) for i in ids], total

    async def update(self, job_id: str, **fields: Any) -> None:
        """The runner's progress: write fields (dicts as JSON), bump the version and wake
        watchers; fenced, as only the leader runs jobs."""
        await self.repo.update(job_id, fields, epoch=self.store.leader_epoch())

    async def finish(self, rec: JobRecord, state: JobState, **fields: Any) -> None:
        """End a job: its state, its last fields, and out of the run's queue (fenced)."""
        await self.repo.finish(
            rec.job_id,
            rec.registration_id,
            state,
            fields,
            finished_at=self.clock(),
            epoch=self.store.leader_epoch(),
        )

    async def request_cancel(self, job_id: str) -> None:
        """Ask the runner to stop the job (any replica takes the request: not fenced)."""
        if not await self.repo.update(job_id, {"cancel": "1"}, epoch=None):
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")

    async def cancel_requested(self, job_id: str) -> bool:
        return await self.repo.cancel_requested(job_id)

    async def open_ids(self) -> list[str]:
        return await self.repo.open_ids()

    async def run_queue(self, rid: str) -> list[str]:
        return await self.repo.run_queue(rid)

    async def drop_from_run(self, rid: str, job_id: str) -> None:
        """Forget a queued job whose record is gone."""
        await self.repo.drop_from_run(rid, job_id)

    # --- default runs -------------------------------------------------------------------
    async def default_run(self, tenant: str) -> dict[str, str]:
        return await self.repo.default_run(tenant)

    async def set_default_run(self, tenant: str, **fields: str) -> None:
        await self.repo.set_default_run(tenant, **fields)

    async def set_default_checkpoint(self, tenant: str, rid: str, checkpoint: str) -> None:
        """After a job on the tenant's default run succeeded: the state its next default run
        resumes, unless `rid` stopped being the default meanwhile (fenced)."""
        await self.repo.set_default_checkpoint(
            tenant, rid, checkpoint, epoch=self.store.leader_epoch()
        )

    async def clear_default_run(self, tenant: str) -> None:
        await self.repo.clear_default_run(tenant)
