"""The page-outs in progress in Redis (paging.py): the `paging` set.

`page_begin` adds a registration to the set and `page_end` / `page_abort` remove it (each a
script, run by paging.py through `store.scripts`, fenced by the leader's epoch). What stays in
the set without a page-out of this controller driving it was interrupted; the leader's sweep
reads it here to abort those.
"""

from __future__ import annotations

from lorafleet_controller.store import Store, text


class PageOutsRepo:
    """The reads of the `paging` set."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def in_progress(self) -> list[str]:
        """Registrations with a page-out begun and neither ended nor aborted."""
        ids: list[str] = []
        for group in self.keys.all_groups():
            ids += [text(raw) for raw in await self.store.redis.smembers(group.paging)]
        return ids
