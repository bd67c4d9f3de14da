"""Send concurrent calls of one Lua script to Redis as one pipeline (`Scripts.run`, coalesced).

Profiling the ledger showed admission dominated by one Redis round trip per
SubmitOperation, mostly socket-write time. Calls issued in the same event-loop tick (the
gRPC handlers that became ready together, or the SDK's pipelined fwd_bwd + optim_step) are
queued, and one callback scheduled with `call_soon` sends them all as a single
non-transactional pipeline of EVALSHA commands. Each script still runs atomically on its
own; only the network trip is shared, and each caller gets its own result or error. A lone
call waits one loop iteration (microseconds), never a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

MAX_BATCH = 128  # commands per pipeline; more queued calls go out as further pipelines

Call = tuple[Sequence[str], Sequence[Any]]  # (KEYS, ARGV) of one script call
Pending = tuple[Call, "asyncio.Future[Any]"]


class Coalescer:
    """`await coalescer(keys, args)` runs `script`, sharing a pipeline with others."""

    def __init__(self, client: Any, script: AsyncScript) -> None:
        self.client = client
        self.script = script
        self._pending: list[Pending] = []
        self._flushes: set[asyncio.Task[None]] = set()

    async def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(((keys, args), future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        for i in range(0, len(batch), MAX_BATCH):
            task = asyncio.create_task(self._send(batch[i : i + MAX_BATCH]))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: list[Pending]) -> None:
        try:
            if len(batch) == 1:  # nothing to share: the plain call is one round trip too
                results = [await self._eval(batch[0][0])]
            else:
                results = await self._pipeline([call for call, _ in batch])
        except BaseException as exc:  # a lost connection fails every caller of the batch
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller was cancelled (e.g. its RPC deadline passed)
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _eval(self, call: Call) -> Any:
        keys, args = call
        try:
            return await self.script(keys=keys, args=args)
        except Exception as exc:
            return exc

    async def _pipeline(self, calls: list[Call]) -> list[Any]:
        """One EVALSHA per call in one round trip; a Redis that lost its script cache
        (restarted) answers NOSCRIPT, and those calls are re-run one by one, which loads it.

        redis-py refuses EVALSHA in a Redis Cluster pipeline: there the calls go out
        concurrently instead (several connections to the fleet's master, no shared trip)."""
        if isinstance(self.client, RedisCluster):
            return list(await asyncio.gather(*(self._eval(call) for call in calls)))
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(self.script.sha, len(keys), *keys, *args)
        # One reply per call, whatever each script returns (redis-py types the list as Any).
        results: list[Any] = await pipe.execute(raise_on_error=False)
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError):
                results[i] = await self._eval(calls[i])
        return results
