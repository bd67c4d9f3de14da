"""Pacing publishes by the CPU they cost the decoding replica.

A replica that decodes in-process (the torch engine) shares its cores with the work of taking
in a publish: receiving and hashing the files, reading, checking and laying out the tensors.
Niceness alone does not bound that work: a publisher that pushes back to back keeps those
threads runnable, so they always take their scheduler share, and one that holds the GIL
when it is preempted stalls the decoding thread too (measured: back-to-back publishing cost
the other adapters 16 % of their throughput at niceness 10, whatever one publish cost, since
a cheaper publish only meant more publishes a second).

So the budget is explicit: the CPU the process spends outside its decoding thread is
charged to a token bucket that refills at `share` CPU-seconds per second (up to `burst`),
and while the engine decodes, a publish starts only when the bucket is not in debt. An
idle engine publishes at once and starts decoding with a full bucket; a publish now and then
never waits; only a publisher that outruns the budget is slowed, to the budget's rate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: CPU seconds publishing may take at once before the publish budget paces it: a few
#: bench-model publishes (~8 ms each across a replica's publishing threads).
PUBLISH_BURST = 0.03
#: How often a paced publish looks again (decoding may have stopped, freeing it at once).
PACE_POLL = 0.05


class CpuBudget:
    """A token bucket of CPU seconds. `wait(used)` charges the spending since the last call
    (`used` is a running total of CPU seconds) and says how long to wait for it to be
    repaid: 0 when the bucket holds at least nothing."""

    def __init__(
        self, share: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share {share} must be in (0, 1]")
        if burst <= 0:
            raise ValueError(f"burst {burst} must be > 0")
        self.share = share
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self._used: float | None = None
        self._last = clock()

    def wait(self, used: float) -> float:
        now = self.clock()
        spent = 0.0 if self._used is None else used - self._used
        self.tokens = min(self.burst, self.tokens + self.share * (now - self._last) - spent)
        self._used, self._last = used, now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.share

    def refill(self, used: float) -> None:
        """Full again from now on: spending while nothing decodes slows no one."""
        self.tokens, self._used, self._last = self.burst, used, self.clock()


class PublishPacer:
    """An engine's publish budget: the CPU of the threads that take in publishes (`watch`),
    charged to a `CpuBudget` while `decoding()` says the engine decodes, forgiven while it
    does not. A share of 0 paces nothing."""

    def __init__(self, share: float, burst: float, decoding: Callable[[], bool]) -> None:
        self._budget = CpuBudget(share, burst) if share else None
        self._decoding = decoding
        #: CPU clocks of the watched threads: the event loop's, which receives and hashes
        #: the files, and the adapter-prep thread's, once they run.
        self._clocks: list[int] = []

    def watch(self) -> None:
        """Charge the calling thread's CPU to publishing from now on. Where threads have no
        CPU clock of their own (not POSIX), nothing is paced."""
        if self._budget is None:
            return
        try:
            self._clocks.append(time.pthread_getcpuclockid(threading.get_ident()))
        except (AttributeError, OSError):
            log.warning("no per-thread CPU clock here: publishes are not paced")
            self._budget = None

    async def wait(self) -> None:
        """While the engine decodes, wait until the CPU the publishing threads took is
        within the budget; an idle engine never waits."""
        while True:
            wait = self.charge()
            if wait <= 0:
                return
            await asyncio.sleep(min(wait, PACE_POLL))  # decoding may stop sooner

    def charge(self) -> float:
        """Charge the publishing threads' CPU since the last call to the budget, or forgive
        it when nothing decodes; return how long a publish must wait now."""
        if self._budget is None:
            return 0.0
        used = sum(map(time.clock_gettime, self._clocks))
        if not self._decoding():
            self._budget.refill(used)
            return 0.0
        return self._budget.wait(used)
