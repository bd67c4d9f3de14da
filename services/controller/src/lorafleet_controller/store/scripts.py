"""The controller's Lua scripts: one per state transition, each atomic in Redis.

A controller killed between two Redis calls never leaves half a transition behind, because
every transition is one script. Each script's source is: the generated constants
(`states.lua_prelude`), the generated `keys` table (`keys.lua_prelude`), `common.lua`, then
the script's body run as a function (after the fencing check when the caller passed an
epoch), then one PUBLISH of every operation it finished, so no script can forget to wake
the long polls.

Calls pass the keys they name in KEYS (the first routes the call on Redis Cluster) and
their arguments in ARGV after the fleet base, the epoch and the call's group (store/keys.py:
every record a call touches is in that group, or in the fleet's scope). Results are flat name/value
lists (`result('code', 'created', ...)` in Lua) read back by name with `named()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from lorafleet import errors
from lorafleet_controller.store import keys as keys_module
from lorafleet_controller.store import states
from lorafleet_controller.store.coalesce import Coalescer
from lorafleet_controller.store.keys import Keys

Client = aioredis.Redis | RedisCluster


def _shared_keys(name: str) -> tuple[str, ...]:
    """The keys a script touches that are no one record's (a group's indexes, the fleet's
    counters and sets), declared in KEYS after the caller's own keys: its first line reads
    `-- keys: family ...`. Declared in the script itself so that adding a script is adding
    one file; a group family resolves in the call's group."""
    first = (_LUA / f"{name}.lua").read_text().split("\n", 1)[0]
    if not first.startswith(_HEADER):
        raise ValueError(f"store/lua/{name}.lua: first line must be {_HEADER!r} and its keys")
    return tuple(first[len(_HEADER) :].split())


_LUA = resources.files("lorafleet_controller.store") / "lua"
_HEADER = "-- keys:"
SHARED_KEYS: dict[str, tuple[str, ...]] = {
    p.name[: -len(".lua")]: _shared_keys(p.name[: -len(".lua")])
    for p in sorted(_LUA.iterdir(), key=lambda p: p.name)
    if p.name.endswith(".lua") and p.name != "common.lua"
}
NAMES = tuple(SHARED_KEYS)


class StaleEpoch(errors.Unavailable):
    """A write carried a leader epoch that a newer leader has superseded: this controller
    was deposed and must stop dispatching (the new leader redoes what it left)."""


def source(name: str, groups: int) -> str:
    body = (_LUA / f"{name}.lua").read_text()
    return (
        "local P = ARGV[1]\n"
        "local ARGS = {}\nfor i = 4, #ARGV do ARGS[i - 3] = ARGV[i] end\n"
        + states.lua_prelude()
        + keys_module.lua_prelude(groups)
        + (_LUA / "common.lua").read_text()
        + f"\nlocal function main()\n{body}\nend\n"
        + "local stale = check_epoch()\nif stale then return stale end\n"
        + "local out = main()\npublish_done()\nreturn out\n"
    )


def named(out: Sequence[Any]) -> dict[str, Any]:
    """A script's `result(...)` list as {name: value} (names decoded, values as Redis gave)."""
    return {text(out[i]): out[i + 1] for i in range(0, len(out), 2)}


def text(value: object, default: str = "") -> str:
    """The one bytes → str codec of the store (Redis answers bytes; absent is None).

    Takes `object` because redis-py types every reply as a union of all it may return."""
    if value is None:
        return default
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def blob(value: object) -> bytes:
    """A stored binary field (a serialized protobuf) as bytes; absent is empty."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class Scripts:
    """The registered scripts of one client: `await scripts.run(name, keys, *args)`."""

    def __init__(self, client: Client, keys: Keys) -> None:
        self.keys = keys
        self._scripts = {name: client.register_script(source(name, keys.groups)) for name in NAMES}
        self._coalescers = {name: Coalescer(client, s) for name, s in self._scripts.items()}

    def _keys(self, name: str, own: Sequence[str], group: int | None) -> list[str]:
        if group is not None:  # a call in a group names only its group's keys (one slot)
            base = self.keys.group(group).base
            if stray := [k for k in own if not k.startswith(base)]:
                raise ValueError(f"script {name} in group {group} was given {stray}")
        shared = []
        for family in SHARED_KEYS[name]:
            if keys_module.KEY_FAMILIES[family][0] == "fleet":
                shared.append(getattr(self.keys, family))
            elif group is None:
                raise ValueError(f"script {name} uses the group's key {family}: pass its group")
            else:
                shared.append(getattr(self.keys.group(group), family))
        return [*own, *shared]

    def _argv(self, epoch: int | None, group: int | None, args: Sequence[Any]) -> list[Any]:
        return [
            self.keys.base,
            "" if epoch is None else epoch,
            "" if group is None else group,
            *args,
        ]

    async def run(
        self,
        name: str,
        own: Sequence[str],
        *args: Any,
        epoch: int | None = None,
        group: int | None = None,
        coalesced: bool = False,
    ) -> Any:
        """Run one script in `group` (that of every record it touches; None: it touches no
        group's keys); `epoch` fences it (refused once a newer leader took over).
        `coalesced` shares one pipeline with the calls of `name` made in the same event-loop
        tick (see store/coalesce.py); same result, same atomicity."""
        keys, argv = self._keys(name, own, group), self._argv(epoch, group, args)
        try:
            if coalesced:
                return await self._coalescers[name](keys, argv)
            return await self._scripts[name](keys=keys, args=argv)
        except ResponseError as exc:
            raise _stale(exc) from None


def _stale(exc: ResponseError) -> Exception:
    message = str(exc)
    if "STALE_EPOCH" in message:
        return StaleEpoch(message[message.index("STALE_EPOCH") :], reason="STALE_EPOCH")
    return exc
