"""The `done` channel's subscription: ids of operations that just finished.

Every script that makes operations terminal PUBLISHes their ids once per call,
newline-separated (`publish_done` in common.lua); this is the one place that subscribes and
splits them. Only the controller's Notifier (notify.py) listens.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def done_ids(client: Any, channel: str) -> AsyncIterator[AsyncIterator[list[str]]]:
    """Subscribed to `channel` once entered; iterate for each message's operation ids.
    `client` is a Redis or RedisCluster client (typed Any: their pubsub types differ)."""
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(channel)
        yield _batches(pubsub)
    finally:
        with contextlib.suppress(Exception):
            await pubsub.aclose()


async def _batches(pubsub: Any) -> AsyncIterator[list[str]]:
    async for message in pubsub.listen():
        if message.get("type") == "message":
            data = message["data"]
            text = data.decode() if isinstance(data, bytes) else data
            yield text.split("\n")
