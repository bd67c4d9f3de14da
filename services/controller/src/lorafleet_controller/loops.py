"""Background loops that outlive errors but never a cancellation.

The controller's loops (sweeper, scheduler intake, data workers, discovery) catch and log
`Exception` so one bad round never stops dispatch. A cancellation that arrives in the
middle of a Redis or gRPC call is not always delivered as CancelledError: a cancelled gRPC
call can surface as an RPC error, and a timeout racing the cancel in Python 3.11 can turn it
into a TimeoutError that the Redis client then retries. The task is still marked as being
cancelled, so each loop asks `stop_requested()` once per round and leaves; without it,
`stop_leading()` waits forever on a loop that lost its CancelledError.
"""

from __future__ import annotations

import asyncio


def stop_requested() -> bool:
    """True once the current task was cancelled, even if the CancelledError was swallowed."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_stopped() -> None:
    if stop_requested():
        raise asyncio.CancelledError
