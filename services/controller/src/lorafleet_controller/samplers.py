"""Samplers and sample operations.

A sampler (`<session>:sample:<n>`) is bound to a published adapter version or to the base
model. SubmitSample stores a SAMPLE operation (idempotent on sampler, seq_id and payload
digest; not seq-ordered) and runs it on its registration's home rollout (placement.py), or
on the least loaded healthy rollout when the home is hot or the sampler is on the base
model. Inflight samplers resolve their registration's newest published version when
the sample is dispatched; snapshot samplers keep the version they were created with.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from dataclasses import dataclass

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2
from lorafleet_controller.clients import Pool
from lorafleet_controller.ledger import Claim, Ledger, admission_limits, backpressure, check_size
from lorafleet_controller.placement import route
from lorafleet_controller.registry import ROLLOUT, Registry, Replica
from lorafleet_controller.residency import Homes, Pusher
from lorafleet_controller.sample_queue import FairQueue
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import OpState, Store
from lorafleet_controller.store.adapters import AdaptersRepo
from lorafleet_controller.store.samplers import SamplerRecord, SamplersRepo
from lorafleet_controller.usage import sample_effects

__all__ = ["SampleSubmission", "SamplerRecord", "Samplers", "sampler_id_of"]

log = logging.getLogger(__name__)


def sampler_id_of(session_id: str, seq: int) -> str:
    return str(contract.SamplerId(session_id, seq))


DOWN_FOR_GOOD = frozenset({"NO_ROLLOUT", "ROLLOUT_FAILED"})
"""Reasons a sample fails at once instead of waiting for a rollout to come back."""


def _no_healthy_rollout(base_model: str, known: list[Replica]) -> errors.Unavailable:
    """Why no rollout can take a sample: none registered or every one failed for good (the
    sample fails at once), or they are restarting or silent (the sample waits)."""
    if not known:
        reason, why = "NO_ROLLOUT", "no rollout replica is registered"
    elif all(r.failed for r in known):
        reason = "ROLLOUT_FAILED"
        why = ", ".join(f"{r.replica_id} (failed: {r.failed})" for r in known) + " is down"
    else:
        reason, why = "NO_HEALTHY_ROLLOUT", "every rollout replica is restarting or silent"
    return errors.Unavailable(
        f"no healthy rollout replica serves {base_model!r}: {why}",
        field="sampler_id",
        reason=reason,
    )


@dataclass(frozen=True)
class SampleSubmission:
    """A sample operation as SubmitSample asks for it. `body` is the rollout's
    SampleRequest, serialised once at the edge (`convert.sample_submission`): the ledger
    stores it, hashes it for idempotency and hands it to the rollout as it is."""

    tenant: str
    sampler_id: str
    seq_id: int
    num_samples: int
    body: bytes


class Samplers:
    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        registry: Registry,
        pool: Pool,
        settings: ControllerSettings,
    ) -> None:
        self.repo = SamplersRepo(store)
        self.room = store.room
        self.pusher = Pusher(AdaptersRepo(store), pool)
        self.homes = Homes(store)
        self.ledger = ledger
        self.registry = registry
        self.pool = pool
        self.settings = settings
        self._load: Counter[str] = Counter()
        self.queue = FairQueue(settings.sample_workers, self._run)

    async def record(
        self,
        *,
        sampler_id: str,
        tenant: str,
        base_model: str,
        model_path: str,
        ref: common_pb2.AdapterRef,
        inflight: bool,
    ) -> SamplerRecord:
        """Record the sampler in one script unless it exists (idempotent on its id)."""
        session = contract.SamplerId.parse(sampler_id, "sampler_id").session_id
        rec = SamplerRecord(sampler_id, tenant, base_model, model_path, ref, inflight)
        if await self.repo.record(rec, session) == "gone":
            raise errors.NotFound(
                f"{ref.registration_id}@{ref.version} is no longer published: nothing held it, "
                "so it was collected",
                field="model_path",
            )
        return await self.get(tenant, sampler_id)

    async def get(self, tenant: str, sampler_id: str) -> SamplerRecord:
        rec = await self.repo.load(sampler_id)
        if rec is None or rec.tenant != tenant:
            raise errors.NotFound(f"no sampler {sampler_id!r}", field="sampler_id")
        return rec

    async def submit(self, sub: SampleSubmission) -> tuple[str, OpState, bool, list[str]]:
        """(operation_id, state, duplicate, sequence_ids) of a sample request."""
        sampler = await self.get(sub.tenant, sub.sampler_id)
        if sub.seq_id < 0:
            raise errors.InvalidArgument("seq_id must be >= 0", field="seq_id")
        check_size(len(sub.body), self.settings, "prompt_tokens")
        opid = f"{sub.sampler_id}#s{sub.seq_id}"
        digest = hashlib.sha256(sub.body).hexdigest()
        self.room.admit("sample")
        limits = admission_limits(self.settings, bucket=False)  # sampling spends no tokens
        now = self.ledger.clock()
        out = await self.repo.submit(
            opid, sub.tenant, digest, sub.body, now, sampler.ref.registration_id, limits
        )
        if out.code == "not_found":
            raise errors.NotFound(f"no sampler {sub.sampler_id!r}", field="sampler_id")
        if out.code == "conflict":
            raise errors.Conflict(
                f"seq_id {sub.seq_id} of {sub.sampler_id} was used with another request",
                field="seq_id",
                reason="PAYLOAD_CONFLICT",
            )
        if out.code == "backpressure":
            raise backpressure(out.scope)
        assert out.state is not None  # created and duplicate answer the operation's state
        seq_ids = [f"{opid}:{i}" for i in range(sub.num_samples)]
        if out.code == "created":
            await self.queue.put(sub.tenant, opid)
        return opid, out.state, out.code == "duplicate", seq_ids

    async def recover(self) -> None:
        """Re-run samples that were open when the previous controller stopped (their tenant
        is not in the stub's id: they share one turn of the fair queue)."""
        for opid in await self.repo.open_samples():
            await self.queue.put("", opid)

    async def stop(self) -> None:
        """Stop running and forget what waits: it stays open in the store for `recover`."""
        await self.queue.stop()

    async def _run(self, opid: str) -> None:
        """Claim and run one sample. Samples run on whichever controller admitted them (no
        leader needed: they are not seq-ordered), so their writes are not fenced."""
        claim = await self.ledger.claim(opid, fenced=False) or await self.ledger.load_claim(opid)
        if claim is None:
            return
        try:
            output = await self._sample_through_restarts(opid, claim)
        except errors.LorafleetError as exc:
            await self.ledger.complete(opid, OpState.FAILED, error=exc, fenced=False)
        except Exception as exc:
            log.exception("sample %s failed", opid)
            await self.ledger.complete(
                opid, OpState.FAILED, error=errors.Internal(str(exc)), fenced=False
            )
        else:
            result = controller_pb2.OperationResult(sample=output)
            await self.ledger.complete(
                opid,
                OpState.SUCCEEDED,
                result.SerializeToString(),
                effects=sample_effects(claim.payload, output),
                fenced=False,
            )

    async def _sample_through_restarts(self, opid: str, claim: Claim) -> common_pb2.SampleOutput:
        """A sample waits out a rollout's restart rather than failing: the SDK cannot retry
        an operation that failed (its seq_id is spent), while a rollout killed or stopped
        comes back in seconds under the supervisor. Unavailable (no healthy replica, or the
        chosen one still unreachable after its transport retries) is retried with backoff
        for `rollout_wait_seconds` from the first refusal; a replica that failed for
        good (its restart budget spent) fails the sample at once, naming it. A replica whose
        queue is full (ResourceExhausted: other controllers' samples, or this one's past its
        bound) is asked again after the `retry_after` it names, for as long as it takes:
        full is transient, and failing would spend the SDK's seq_id. Running a sample again
        changes nothing: it writes no state and is seeded."""
        loop = asyncio.get_running_loop()
        deadline, delay = None, 0.05
        while True:
            try:
                return await self._sample(opid, claim)
            except errors.ResourceExhausted as exc:
                log.info("sample %s waits for room on a rollout: %s", opid, exc)
                await asyncio.sleep(min(max(exc.retry_after, 0.01), 5.0))
            except errors.Unavailable as exc:
                now = loop.time()
                deadline = deadline or now + self.settings.rollout_wait_seconds
                if now >= deadline or exc.reason in DOWN_FOR_GOOD:
                    raise
                log.info("sample %s waits for a rollout: %s", opid, exc)
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 1.0)

    async def _sample(self, opid: str, claim: Claim) -> common_pb2.SampleOutput:
        sampler_id = opid.rsplit("#s", 1)[0]
        tenant = claim.tenant
        sampler = await self.get(tenant, sampler_id)
        ref = common_pb2.AdapterRef()
        ref.CopyFrom(sampler.ref)
        if sampler.inflight and ref.registration_id:
            reg = await self.registry.get_any(ref.registration_id)
            if reg is not None and reg.published_version:
                ref.version = reg.published_version
        req = rollout_pb2.SampleRequest.FromString(claim.payload)
        req.request_id = opid
        req.adapter.CopyFrom(ref)
        known = await self.registry.replicas(ROLLOUT, sampler.base_model)
        rollouts = [r for r in known if r.healthy]
        if not rollouts:
            raise _no_healthy_rollout(sampler.base_model, known)
        if ref.registration_id:
            home = await self.homes.home(ref.registration_id, sampler.base_model, rollouts)
            chosen = route(home, rollouts, self._load, self.settings.sample_spread_inflight)
        else:
            chosen = min(rollouts, key=lambda r: (self._load[r.replica_id], r.replica_id))
        self._load[chosen.replica_id] += 1
        try:
            client = self.pool.rollout(chosen.address)
            try:
                return await client.sample(req)
            except errors.NotFound as exc:
                if exc.reason != "VERSION_NOT_RESIDENT" or not ref.registration_id:
                    raise
                # The replica does not hold a live version (its home moved here, a hot
                # adapter spread here, it restarted and its reconcile is still running or
                # was lost with a controller): give it the version, then serve.
                try:
                    restored = await self.pusher.restore(chosen.address, ref)
                except errors.LorafleetError as push_error:
                    log.warning("restoring %s on %s failed: %s", ref, chosen.replica_id, push_error)
                    raise exc from None
                if not restored:
                    raise
                log.info(
                    "%s@%s was not on %s: restored it for %s",
                    ref.registration_id,
                    ref.version,
                    chosen.replica_id,
                    opid,
                )
                return await client.sample(req)
        finally:
            self._load[chosen.replica_id] -= 1
