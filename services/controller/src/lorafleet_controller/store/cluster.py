"""The Redis Cluster client: redis-py's, with a node's disconnect made safe for commands in
flight.

Why: redis-py 8.1's asyncio cluster client, on a MOVED past `reinitialize_steps`, a
CLUSTERDOWN or an uncovered slot, closes itself (`RedisCluster.aclose` -> every node's
`ClusterNode.disconnect`), which closes every connection of every node, including those other
tasks are using at that moment: their command then fails with `AttributeError: 'NoneType'
object has no attribute 'writelines'` (its stream was set to None under it), which no retry
recognises, so the controller's call fails. Seen in `bench/ledger.py --cluster` at 32
registrations (a MOVED on the fresh cluster's first commands), and reproduced by closing the
client under 60 concurrent commands: 31 of 1,200 failed. `disconnect_free_connections` (run
after a connection error) has the same race for a free connection picked up while it is being
closed.

Here a node closes its free connections at once, taken out of the free list while they close,
and marks those in use to reconnect: each is closed when its command is done (redis-py's own
lazy path, `ClusterNode.release`, as its `set_nodes` already does for a topology refresh).
Installed once, process-wide, by `cluster_client`; it refuses to install over a redis-py
whose ClusterNode lacks what it uses, so an upgrade that changes them fails loudly here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster

#: What `_disconnect` and `_close_free` use of ClusterNode.
_NEEDS = ("update_active_connections_for_reconnect", "disconnect", "disconnect_free_connections")


async def _close_free(node: ClusterNode) -> None:
    """Close the node's free connections, out of the free list while they close."""
    free = list(node._free)
    node._free.clear()
    try:
        results = await asyncio.gather(*(c.disconnect() for c in free), return_exceptions=True)
    finally:
        node._free.extend(free)
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed


async def _disconnect(node: ClusterNode) -> None:
    """ClusterNode.disconnect: connections in use close once their command is done."""
    node.update_active_connections_for_reconnect()
    await _close_free(node)


def _install() -> None:
    missing = [name for name in _NEEDS if not hasattr(ClusterNode, name)]
    if missing or "_free" not in ClusterNode.__slots__:
        raise RuntimeError(f"redis-py's ClusterNode changed ({missing}): see store/cluster.py")
    ClusterNode.disconnect = _disconnect  # type: ignore[method-assign,assignment]
    ClusterNode.disconnect_free_connections = _close_free  # type: ignore[method-assign,assignment]


_install()


def cluster_client(url: str, **options: Any) -> RedisCluster:
    """A RedisCluster client for `url` (options as RedisCluster.from_url's)."""
    return RedisCluster.from_url(url, **options)
