"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Safety rests on two rules. A candidate takes the Lease only after it has seen the same
holder record, unchanged, for a full `lease_duration` of its *own* clock (so clock skew
between nodes does not matter, only clock rate). The leader stops leading, and calls
`on_stopped_leading` so dispatch stops, once it has failed to renew for `renew_deadline`,
which is shorter than `lease_duration`; so it has stepped down before anyone may take over.
Every write is a replace carrying the resourceVersion that was read, so two candidates
racing for the same record cannot both win: the API server answers the loser 409.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None] | None]


def _now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaderElector:
    """Acquire and renew one Lease; `is_leader` is true only while the lease is safely held.

    Dispatch code checks `is_leader` before each write: it turns false by the clock alone at
    the renew deadline, while `on_stopped_leading` may run a scheduling tick later.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_started_leading: Callback | None = None,
        on_stopped_leading: Callback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < retry_period < renew_deadline < lease_duration:
            raise ValueError("need 0 < retry_period < renew_deadline < lease_duration")
        if not identity:
            raise ValueError("identity must be non-empty (the pod name)")
        self._api = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._on_started = on_started_leading
        self._on_stopped = on_stopped_leading
        self._clock = clock
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._last_renew: float | None = None  # start of our last successful write
        self._epoch = 0  # bumped on step-down; a write that started before it counts for nothing
        self._lock = threading.Lock()
        self._leading = False  # on_started_leading was called and on_stopped_leading not yet
        self._timeout = renew_deadline  # per API request, so no call hangs forever
        # Attempts whose threads have not returned, including those a leader stopped waiting
        # for at its renew deadline: `run` lets them all land before it releases the lease.
        self._attempts: set[asyncio.Future[bool]] = set()

    @property
    def is_leader(self) -> bool:
        """True while we hold the lease and renewed it within `renew_deadline`."""
        return (
            self._last_renew is not None and self._clock() - self._last_renew < self.renew_deadline
        )

    async def run(self) -> None:
        """Campaign and renew until cancelled; step down (and release) on the way out."""
        try:
            while True:
                # A leader waits for an attempt only until its renew deadline: a hung API
                # call must not keep it leading (the thread may finish later, harmlessly).
                last = self._last_renew
                budget = (
                    None if last is None else max(0.0, last + self.renew_deadline - self._clock())
                )
                try:
                    attempt = asyncio.ensure_future(asyncio.to_thread(self.try_acquire_or_renew))
                    self._attempts.add(attempt)
                    attempt.add_done_callback(self._attempts.discard)
                    async with asyncio.timeout(budget):
                        renewed = await asyncio.shield(attempt)
                except TimeoutError:
                    renewed = False
                except Exception:  # network, 5xx: keep trying; the deadline decides
                    log.warning("lease %s: acquire/renew failed", self.name, exc_info=True)
                    renewed = False
                if renewed and self.is_leader and not self._leading:
                    log.info("lease %s: %s is now the leader", self.name, self.identity)
                    self._leading = True
                    await _call(self._on_started)
                elif self._leading and not self.is_leader:
                    await self._step_down("lease lost or not renewed in time")
                await asyncio.sleep(self.retry_period)
        finally:
            # An attempt still in flight (the current one, or one abandoned at a renew
            # deadline whose request was held by the network) may yet write us in as holder:
            # stepping down makes it count for nothing here, not on the server. Let them all
            # land, then release, so no late write leaves the lease held by nobody leading.
            in_flight = set(self._attempts)
            held = self._last_renew is not None
            await self._step_down("stopping")
            if in_flight:
                await asyncio.wait(in_flight, timeout=self._timeout)
            if held or in_flight:
                await asyncio.to_thread(self._release)

    async def _step_down(self, why: str) -> None:
        with self._lock:
            self._last_renew = None
            self._epoch += 1
        if not self._leading:
            return
        self._leading = False
        log.warning("lease %s: %s stops leading (%s)", self.name, self.identity, why)
        await _call(self._on_stopped)

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking). True if we hold the lease now."""
        now, epoch = self._clock(), self._epoch
        try:
            lease = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create(now, epoch) if epoch == self._epoch else False
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity or ""
        record = (holder, spec.renew_time.isoformat() if spec.renew_time else "")
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = spec.lease_duration_seconds or self.lease_duration
        if holder and holder != self.identity and now - self._observed_at < duration:
            with self._lock:  # someone else holds an unexpired lease: we cannot be leading
                self._last_renew = None
            return False
        if epoch != self._epoch:  # we stepped down while the read was held: do not write
            return False
        renewed_at = _now_utc()
        if holder != self.identity:
            spec.acquire_time = renewed_at
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self.lease_duration)
        spec.renew_time = renewed_at
        lease.spec = spec
        try:
            self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 409:  # somebody wrote first; re-read next round
                return False
            raise
        return self._won(now, epoch)

    def _won(self, started: float, epoch: int) -> bool:
        with self._lock:
            if epoch != self._epoch:
                return False
            self._last_renew = started
        return self.is_leader

    def _create(self, now: float, epoch: int) -> bool:
        stamp = _now_utc()
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=int(self.lease_duration),
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=0,
            ),
        )
        try:
            self._api.create_namespaced_lease(self.namespace, body, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 409:  # created by another candidate in between
                return False
            raise
        return self._won(now, epoch)

    def _release(self) -> None:
        """Hand the lease back so a standby takes over at once instead of after expiry."""
        try:
            lease = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout
            )
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _now_utc()
            self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self._timeout
            )
        except Exception:  # best effort: otherwise the lease simply expires
            log.warning("lease %s: release failed", self.name, exc_info=True)


async def _call(callback: Callback | None) -> None:
    if callback is not None:
        result = callback()
        if asyncio.iscoroutine(result):
            await result
