"""Admitted samples wait here for one of a fixed number of workers, taken fairly by tenant.

Why: a task per admitted sample let one tenant's flood of thousands put thousands of
requests on the rollouts at once; a rollout refuses past its queue bound, so every tenant's
samples behind the flood failed with it. Here a controller runs at most `workers` samples at
a time, and a worker that frees up takes the next sample of the tenant after the one it
served last (round robin over the tenants with samples waiting, FIFO within a tenant): a
tenant with one sample waiting behind another's two thousand runs it within one turn.

Pure asyncio and in memory: what is waiting is also open in the store (`open_samples`), so a
controller that restarts re-queues it (`Samplers.recover`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class FairQueue:
    def __init__(self, workers: int, run: Callable[[str], Awaitable[None]]) -> None:
        self.workers = workers
        self._run = run
        self._waiting: dict[str, collections.deque[str]] = {}
        self._turns: collections.deque[str] = collections.deque()  # tenants with samples waiting
        self._ready = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self.running = 0

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values()))

    async def stop(self) -> None:
        """Cancel the running samples and drop the waiting ones; the next `put` starts the
        workers again (a controller admits samples whether it leads or not)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._waiting.clear()
        self._turns.clear()

    async def put(self, tenant: str, opid: str) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._work(), name=f"sample-worker-{i}")
                for i in range(self.workers)
            ]
        async with self._ready:
            if tenant not in self._waiting:
                self._waiting[tenant] = collections.deque()
                self._turns.append(tenant)
            self._waiting[tenant].append(opid)
            self._ready.notify()

    async def _next(self) -> str:
        async with self._ready:
            await self._ready.wait_for(lambda: bool(self._turns))
            tenant = self._turns.popleft()
            queue = self._waiting[tenant]
            opid = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next sample waits for the others' turns
            else:
                del self._waiting[tenant]
            return opid

    async def _work(self) -> None:
        while True:
            opid = await self._next()
            self.running += 1
            try:
                await self._run(opid)
            except Exception:  # `run` records its own failures; a bug must not stop a worker
                log.exception("sample %s", opid)
            finally:
                self.running -= 1
