"""The controller's Lua scripts: one per state transition, each atomic in Redis.

A controller killed between two Redis calls never leaves half a transition behind, because
every transition is one script. Each script's source is: the generated constants
(`states.lua_prelude`), the generated `keys` table (`keys.lua_prelude`), `common.lua`, then
the script's body run as a function (after the fencing check when the caller passed an
epoch), then one PUBLISH of every operation it finished, so no script can forget to wake
the long polls.

Calls pass the keys they name in KEYS (the first routes the call on Redis Cluster) and
their arguments in ARGV after the fleet base and the epoch. Results are flat name/value
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


def _fleet_keys(name: str) -> tuple[str, ...]:
    """The fleet-wide keys a script touches, declared in KEYS after the caller's own keys:
    its first line reads `-- fleet-keys: name ...` (attribute names of `Keys`). Declared in
    the script itself so that adding a script is adding one file."""
    first = (_LUA / f"{name}.lua").read_text().split("\n", 1)[0]
    if not first.startswith(_HEADER):
        raise ValueError(f"store/lua/{name}.lua: first line must be {_HEADER!r} and its keys")
    return tuple(first[len(_HEADER) :].split())


_LUA = resources.files("lorafleet_controller.store") / "lua"
_HEADER = "-- fleet-keys:"
FLEET_KEYS: dict[str, tuple[str, ...]] = {
    p.name[: -len(".lua")]: _fleet_keys(p.name[: -len(".lua")])
    for p in sorted(_LUA.iterdir(), key=lambda p: p.name)
    if p.name.endswith(".lua") and p.name != "common.lua"
}
NAMES = tuple(FLEET_KEYS)


class StaleEpoch(errors.Unavailable):
    """A write carried a leader epoch that a newer leader has superseded: this controller
    was deposed and must stop dispatching (the new leader redoes what it left)."""


def source(name: str) -> str:
    body = (_LUA / f"{name}.lua").read_text()
    return (
        "local P = ARGV[1]\n"
        "local ARGS = {}\nfor i = 3, #ARGV do ARGS[i - 2] = ARGV[i] end\n"
        + states.lua_prelude()
        + keys_module.lua_prelude()
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
        self._scripts = {name: client.register_script(source(name)) for name in NAMES}
        self._coalescers = {name: Coalescer(client, s) for name, s in self._scripts.items()}

    def _keys(self, name: str, own: Sequence[str]) -> list[str]:
        return [*own, *(getattr(self.keys, k) for k in FLEET_KEYS[name])]

    def _argv(self, epoch: int | None, args: Sequence[Any]) -> list[Any]:
        return [self.keys.base, "" if epoch is None else epoch, *args]

    async def run(self, name: str, own: Sequence[str], *args: Any, epoch: int | None = None) -> Any:
        """Run one script; `epoch` fences it (refused once a newer leader took over)."""
        try:
            return await self._scripts[name](
                keys=self._keys(name, own), args=self._argv(epoch, args)
            )
        except ResponseError as exc:
            raise _stale(exc) from None

    async def run_coalesced(
        self, name: str, own: Sequence[str], *args: Any, epoch: int | None = None
    ) -> Any:
        """`run`, but sharing one pipeline with the calls of `name` made in the same
        event-loop tick (see store/coalesce.py); same result, same atomicity."""
        try:
            return await self._coalescers[name](self._keys(name, own), self._argv(epoch, args))
        except ResponseError as exc:
            raise _stale(exc) from None


def _stale(exc: ResponseError) -> Exception:
    message = str(exc)
    if "STALE_EPOCH" in message:
        return StaleEpoch(message[message.index("STALE_EPOCH") :], reason="STALE_EPOCH")
    return exc
