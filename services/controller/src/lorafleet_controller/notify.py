"""Wake long-polling GetOperation calls when an operation finishes.

Every Lua script that makes operations terminal PUBLISHes their ids on `<prefix>done`, once
per script call and newline-separated, so a batch of completions costs one message. One
subscription per controller (store/notify.py) fans the messages out to in-process waiters,
so a thousand long polls cost one Redis connection, not a thousand. Waiters always re-read
the record from Redis: the message is only a wake-up, never the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from lorafleet_controller.store import Store

log = logging.getLogger(__name__)


class Notifier:
    """The wake-ups of one controller, from its store's `done` subscription."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="notifier")
        async with asyncio.timeout(10):
            await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def watch(self, opid: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._waiters.setdefault(opid, set()).add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(opid)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[opid]

    def _wake(self, opid: str) -> None:
        for event in self._waiters.get(opid, ()):
            event.set()

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    async def _run(self) -> None:
        while True:
            try:
                async with self.store.done_ids() as batches:
                    self._ready.set()
                    # A reconnect may have missed messages: let every waiter re-read its record.
                    self._wake_all()
                    async for opids in batches:
                        for opid in opids:
                            self._wake(opid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection loss: resubscribe after a pause
                log.warning("notifier subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
