"""The controller's Redis store: every key name, codec, stored enum and Lua outcome.

Ledger, registry, catalog, samplers, tenancy and publishing reach Redis only through a
`Store`: key names come from `store.keys`, transitions are `store.scripts` (one Lua script
each, results read by name), stored states are `OpState` / `RegState`, and bytes become
text through `text`. `connect` builds the client for one Redis or a Redis Cluster
(`LORAFLEET_CONTROLLER_REDIS_CLUSTER`); see `keys.py` for the hash tags (groups, fleet).
A store call that Redis fails (connection lost, timeout, error reply) raises `StoreError`
(redis-py's `RedisError`), so callers that retry later need not import redis-py.

Fencing: a controller that starts dispatching takes a new epoch (`take_epoch`, an INCR of
the fleet's epoch counter, copied into every group) and passes it with every dispatch write
(claims, outcomes, sweeps, placements, replica losses); the scripts refuse an epoch that is
no longer the newest (`StaleEpoch`). A deposed leader therefore cannot change the ledger
even in the moments it still believes it leads; requests any replica serves (submit, ack,
create) are not fenced, since every replica may take them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError as StoreError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from lorafleet import errors
from lorafleet_controller.store.cluster import cluster_client
from lorafleet_controller.store.keys import Keys
from lorafleet_controller.store.notify import done_ids as subscribe_done
from lorafleet_controller.store.room import Room
from lorafleet_controller.store.scripts import Client, Scripts, StaleEpoch, blob, named, text
from lorafleet_controller.store.states import DATA_KINDS, OPEN, TERMINAL, OpState, RegState

__all__ = [
    "DATA_KINDS",
    "OPEN",
    "TERMINAL",
    "Client",
    "Keys",
    "OpState",
    "RegState",
    "Scripts",
    "StaleEpoch",
    "Store",
    "StoreError",
    "blob",
    "connect",
    "named",
    "text",
    "unreachable",
]


# Connections to one Cluster node. redis-py's asyncio Cluster client fails a command at its
# default of 100 (MaxConnectionsError) instead of waiting; the controller runs a call per
# group at once (a sweep, a batch's outcomes, a new epoch), one BLPOP per group, and its
# gRPC handlers' submits, which pass 100 on a master holding many groups.
MAX_NODE_CONNECTIONS = 4096
# One redis-server's pool (the same calls, on one server): its size, and how long a command
# waits for a connection when all are in use before it fails.
MAX_CONNECTIONS = 1024
POOL_WAIT_SECONDS = 30.0


def connect(url: str, *, cluster: bool = False) -> Client:
    """A client that reconnects and retries across a Redis restart (or a Cluster failover).

    Retrying is safe: every script is idempotent (a replayed submit is a duplicate, a
    replayed claim or completion finds the state already moved and does nothing).
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=20)
    if cluster:
        return cluster_client(
            url,
            retry=retry,
            socket_connect_timeout=2,
            health_check_interval=5,
            # Maintenance notifications are Redis Enterprise's: open-source Redis refuses the
            # handshake command, which cost every new connection a failed round trip.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
            max_connections=MAX_NODE_CONNECTIONS,
            # A MOVED patches the one slot; redis-py's default closed the whole client every
            # fifth MOVED, and a cold client under concurrent commands (all sent before it
            # knew the slots) then thrashed: 235 closes for 2,048 submits, a fourth of the
            # throughput (test_cluster_client). Failover and resharding answer MOVED too.
            reinitialize_steps=0,
        )
    # A blocking pool: past its size a command waits for a free connection. redis-py's
    # default pool fails it at once past 100 (MaxConnectionsError), which a loaded controller
    # reached (64 sample workers, the gRPC handlers' submits, the scheduler's claims): a
    # sample flood failed samples with INTERNAL on a busy 2-core machine.
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_SECONDS,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=5,
        socket_connect_timeout=2,
    )
    client = aioredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # as from_url's: aclose() closes the pool
    return client


def unreachable(url: str, *, cluster: bool = False) -> str | None:
    """Why Redis at `url` cannot be reached now (one synchronous PING), or None: checked at
    start-up so that a wrong URL stops the controller with one line, not retries forever."""
    import redis

    try:
        if cluster:
            redis.RedisCluster.from_url(url, socket_connect_timeout=3).ping()
        else:
            redis.Redis.from_url(url, socket_connect_timeout=3).ping()
    except (redis.RedisError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return None


class Store:
    """One fleet's view of Redis: its client, key names, scripts and fencing epoch."""

    def __init__(
        self,
        client: Client,
        prefix: str,
        groups: int,
        *,
        full_fraction: float = 0.9,
        room_check_seconds: float = 1.0,
    ) -> None:
        self.redis = client
        self.keys = Keys(prefix, groups)
        self.scripts = Scripts(client, self.keys)
        self.epoch: int | None = None  # set while this controller dispatches
        # admission refuses new work before Redis reaches maxmemory (store/room.py)
        self.room = Room(client, full_fraction, room_check_seconds)

    async def ping(self) -> None:
        """Raise (StoreError) unless Redis answers now: a controller checks it as it starts."""
        await self.redis.ping()

    async def close(self) -> None:
        await self.redis.aclose()

    def done_ids(self) -> AbstractAsyncContextManager[AsyncIterator[list[str]]]:
        """A subscription to the ids of operations as they finish (store/notify.py)."""
        return subscribe_done(self.redis, self.keys.done)

    async def check_layout(self) -> None:
        """Record the fleet's group count on first start, and refuse another one later: the
        groups decide where every record lives (store/keys.py), so a controller configured
        with a different count would not find them."""
        await self.redis.set(self.keys.layout, self.keys.groups, nx=True)
        stored = int(await self.redis.get(self.keys.layout) or 0)
        if stored != self.keys.groups:
            raise errors.FailedPrecondition(
                f"this fleet's keys are laid out in {stored} groups, not {self.keys.groups}: "
                "set ledger_groups to the fleet's (or start on an empty Redis)",
                field="ledger_groups",
            )

    async def take_epoch(self) -> int:
        """Become the newest dispatcher: every older epoch's writes are refused from now.

        The fleet's counter is the authority; each group keeps a copy its scripts check
        (common.lua), installed here in every group before this controller dispatches, so a
        deposed leader's writes fail in a group as soon as the new leader may write there."""
        epoch = int(await self.redis.incr(self.keys.epoch))
        if self.keys.groups > 1:
            await asyncio.gather(
                *(
                    self.scripts.run("epoch_install", [], epoch, group=g)
                    for g in range(self.keys.groups)
                )
            )
        self.epoch = epoch
        return epoch

    def drop_epoch(self) -> None:
        self.epoch = None

    def leader_epoch(self) -> int:
        """The epoch dispatch writes carry; StaleEpoch when this controller is not leading."""
        if self.epoch is None:
            raise StaleEpoch("this controller is not dispatching", reason="STALE_EPOCH")
        return self.epoch
