"""The fair queue's order: round robin over tenants, FIFO within one."""

from __future__ import annotations

import asyncio

from lorafleet.testing import wait_until_async
from lorafleet_controller.sample_queue import FairQueue


async def test_a_tenant_behind_a_flood_waits_one_turn() -> None:
    ran: list[str] = []
    gate = asyncio.Event()

    async def run(opid: str) -> None:
        await gate.wait()  # the first sample holds the one worker while the rest queue up
        ran.append(opid)

    queue = FairQueue(1, run)
    for i in range(5):
        await queue.put("flood", f"f{i}")
    await wait_until_async(lambda: queue.running == 1, "the worker running f0")
    await queue.put("other", "o0")
    await queue.put("other", "o1")
    await queue.put("third", "t0")
    assert len(queue) == 7
    gate.set()
    await wait_until_async(lambda: len(ran) == 8, "every sample run")
    assert ran == ["f0", "f1", "o0", "t0", "f2", "o1", "f3", "f4"]
    await queue.stop()
    assert len(queue) == 0 and queue.running == 0
