"""The Redis Cluster client keeps commands in flight alive when it closes its connections
(store/cluster.py): redis-py does that itself on a MOVED past `reinitialize_steps` or a
CLUSTERDOWN, and its own close broke the commands other tasks were running."""

from __future__ import annotations

import asyncio

from lorafleet.testing import RedisClusterNodes
from lorafleet_controller.store import connect

COMMANDS = 60
ROUNDS = 20


async def test_commands_in_flight_survive_the_client_closing_its_connections(
    redis_cluster: RedisClusterNodes,
) -> None:
    client = connect(redis_cluster.url, cluster=True)
    await client.ping()
    failures: list[BaseException] = []

    async def incr(i: int) -> None:
        try:
            await client.incr(f"{{k{i % 16}}}:n")
        except Exception as exc:  # collected: every one is a failure
            failures.append(exc)

    try:
        for round_ in range(ROUNDS):
            tasks = [asyncio.create_task(incr(i)) for i in range(COMMANDS)]
            await asyncio.sleep(0.001 * (round_ % 5))  # some connecting, some reading
            await client.aclose()  # what redis-py runs on MOVED x reinitialize_steps
            await asyncio.gather(*tasks)
        # Before store/cluster.py: ~31 of 1,200 failed with AttributeError ('NoneType' object
        # has no attribute 'writelines'), their connection closed under them.
        assert failures == []
        counts = [int(await client.get(f"{{k{k}}}:n") or 0) for k in range(16)]
        assert sum(counts) == COMMANDS * ROUNDS  # each applied once, none twice
    finally:
        await client.aclose()
