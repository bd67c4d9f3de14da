"""Load the controller's Lua scripts: each is `common.lua` followed by its own body.

Every ledger and registry transition is one script, so it is atomic in Redis and a crash of
the controller between two Redis calls can never leave half a transition behind.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from lorafleet_controller.coalesce import Coalescer

NAMES = (
    "submit", "claim", "claim_many", "complete", "ack", "sweep", "seal", "fence",
    "place", "bound", "release", "replica_lost", "repush", "create_reg", "submit_sample",
)  # fmt: skip


def _source(name: str) -> str:
    """`common.lua`, then the script's body run as a function, then one PUBLISH of every
    operation it finished (so no script can forget to wake the long polls)."""
    folder = resources.files("lorafleet_controller") / "scripts"
    body = (folder / f"{name}.lua").read_text()
    return (
        (folder / "common.lua").read_text()
        + f"\nlocal function main()\n{body}\nend\nlocal out = main()\npublish_done()\nreturn out\n"
    )


class Scripts:
    """The registered scripts of one Redis client, called as `await scripts.run(name, *args)`."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.prefix = prefix
        self._scripts = {name: client.register_script(_source(name)) for name in NAMES}
        self._coalescers = {name: Coalescer(client, s) for name, s in self._scripts.items()}

    async def run(self, name: str, *args: Any) -> Any:
        return await self._scripts[name](keys=[], args=[self.prefix, *args])

    async def run_coalesced(self, name: str, *args: Any) -> Any:
        """`run`, but sharing one pipeline with the calls of `name` made in the same
        event-loop tick (see coalesce.py); same result, same atomicity."""
        return await self._coalescers[name]([self.prefix, *args])
