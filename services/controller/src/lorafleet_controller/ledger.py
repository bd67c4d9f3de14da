"""The operation ledger: per-registration ordered, idempotent, durable operations in Redis.

Semantics copied from the miles ledger (design-lessons §3) and made durable: every state
transition is one Lua script (`store/lua/*.lua`), so a controller killed at any instant leaves
either the old or the new state, never half of one. Operation ids are derived from the
identity the client already has, `<registration_id>#<seq_id>`, so a retried submission lands
on its original record without any lookup table.

States (`store.OpState`): QUEUED → CLAIMED → SUCCEEDED | FAILED(user|server) | CANCELLED, then
EXPIRED once the result was acknowledged `acked_result_grace_seconds` ago (the sweep releases
it) or outlives `result_ttl_seconds`. Its record then goes (compacted: the registration's
head answers for every seq_id below it, store/lua/common.lua), so a run of a million steps
keeps no stub per step; the seq_id stays spent forever. Limits are per
registration, per tenant and for the fleet (see submit).
Dispatch writes (claims, outcomes, sweeps) carry the leader's epoch (`store.Store`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from lorafleet import contract, errors
from lorafleet.v1 import controller_pb2
from lorafleet_controller import metrics
from lorafleet_controller.notify import Notifier
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import TERMINAL, OpState, RegState, Store, named, text
from lorafleet_controller.store.operations import OperationsRepo, StoredOp
from lorafleet_controller.store.quota import ADMIT_TRIES, Limits, Quota, lease_needs

WaitingFor: TypeAlias = controller_pb2.WaitingFor.ValueType
BACKPRESSURE_SCOPES = {
    "registration": "open operations of this registration",
    "tenant": "open operations of this tenant",
    "global": "open operations of the fleet",
    "tenant_results": "unacknowledged results of this tenant",
    "results": "unacknowledged results of the fleet",
    "tenant_bytes": "payload bytes in this tenant's open operations "
    "(LORAFLEET_CONTROLLER_MAX_PENDING_BYTES_PER_TENANT)",
    "global_bytes": "payload bytes in the fleet's open operations "
    "(LORAFLEET_CONTROLLER_MAX_PENDING_BYTES_GLOBAL)",
    "tenant_result_bytes": "bytes in this tenant's unacknowledged results "
    "(LORAFLEET_CONTROLLER_MAX_UNACKED_BYTES_PER_TENANT)",
    "result_bytes": "bytes in the fleet's unacknowledged results "
    "(LORAFLEET_CONTROLLER_MAX_UNACKED_BYTES_GLOBAL)",
    "rate": "admissions per second for this tenant",
}


def operation_id(registration_id: str, seq_id: int) -> str:
    return f"{registration_id}#{seq_id}"


def error_json(exc: errors.LorafleetError) -> str:
    """The stored form of an operation's error (JSON, so Lua scripts can write it too)."""
    return json.dumps(
        {
            "category": exc.category,
            "field": exc.field,
            "message": exc.message,
            "reason": exc.reason or type(exc).__name__,
        }
    )


@dataclass(frozen=True)
class Admission:
    operation_id: str
    state: OpState
    duplicate: bool
    page_in: str = ""  # base model of a PAGED registration this admission queued (paging.py)


@dataclass(frozen=True)
class OpRecord:
    operation_id: str
    registration_id: str
    tenant: str
    seq_id: int
    kind: int
    state: OpState
    payload: bytes
    result: bytes
    error: dict[str, str] | None
    submitted_at: float
    finished_at: float
    waiting_reason: str
    waiting_for: WaitingFor
    version: int

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class Outcome:
    """What became of one claimed operation, for `Ledger.complete_many`."""

    operation_id: str
    state: OpState
    result: bytes = b""
    error: errors.LorafleetError | None = None
    effects: Sequence[tuple[str, str, Any]] = ()
    # The number of the claim this answers (Claim.claim); 0 records under whatever claim
    # holds the operation.
    claim: int = 0


@dataclass(frozen=True)
class Claim:
    operation_id: str
    registration_id: str
    seq_id: int
    kind: int
    payload: bytes
    replica: str
    slot: int
    dirty: bool
    base_model: str
    tenant: str
    submitted_at: float
    # Which claim of the operation this is (claim_op counts them): an operation re-queued and
    # claimed again is held only by its newest claim.
    claim: int

    @classmethod
    def decode(cls, out: Sequence[Any]) -> Claim:
        """A claim from the named result of `claim_op` (store/lua/common.lua)."""
        return cls.of(named(out))

    @classmethod
    def of(cls, f: Mapping[str, Any]) -> Claim:
        """A claim from its fields by `claim_op`'s names, as Redis gave them."""
        slot = text(f["slot"])
        return cls(
            operation_id=text(f["operation_id"]),
            registration_id=text(f["registration_id"]),
            seq_id=int(f["seq_id"] or 0),
            kind=int(f["kind"] or 0),
            payload=f["payload"] or b"",
            replica=text(f["replica"]),
            slot=int(slot) if slot not in ("", "-1") else -1,
            dirty=text(f["dirty"]) == "1",
            base_model=text(f["base_model"]),
            tenant=text(f["tenant"]),
            submitted_at=float(f["submitted_at"] or 0),
            claim=int(f["claim"] or 0),
        )


@dataclass(frozen=True)
class Swept:
    claims_failed: int
    results_expired: int
    gaps_sealed: int


class Ledger:
    """Admission, claims, outcomes, acknowledgement and housekeeping of operations."""

    def __init__(
        self,
        store: Store,
        settings: ControllerSettings,
        notifier: Notifier,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.operations = OperationsRepo(store)
        self.quota = Quota(store)
        self.settings = settings
        self.notifier = notifier
        self.clock = clock
        # How far ahead of the oldest open seq_id a submission may be: twice the pending
        # limit, so backpressure (retryable) is met long before the window (a user error).
        self.window = 2 * settings.max_pending_per_registration

    # --- admission ------------------------------------------------------------------------
    async def submit(
        self,
        tenant: str,
        registration_id: str,
        seq_id: int,
        kind: int,
        payload: bytes,
        digest: str,
        rejection: errors.LorafleetError | None = None,
    ) -> Admission:
        """Admit (or find) the operation at (registration_id, seq_id).

        `rejection` makes a born-terminal FAILED record: the payload failed validation, but
        the seq_id is consumed so the registration's queue never waits for it.
        """
        s = self.settings
        if seq_id <= 0:
            raise errors.InvalidArgument(
                f"seq_id must be >= 1, got {seq_id}", field="seq_id", reason="SEQ_OUT_OF_RANGE"
            )
        check_size(len(payload), s, "payload")
        self.store.room.admit("operation")
        return await self._admit(tenant, registration_id, seq_id, kind, payload, digest, rejection)

    async def create_internal(
        self, registration_id: str, tenant: str, seq_id: int, kind: int, payload: bytes
    ) -> str:
        """Admit a controller-made operation (the seq 0 load of create-via-load)."""
        adm = await self._admit(
            tenant,
            registration_id,
            seq_id,
            kind,
            payload,
            f"internal:{kind}",
            None,
            bucket=False,
        )
        return adm.operation_id

    async def _admit(
        self,
        tenant: str,
        registration_id: str,
        seq_id: int,
        kind: int,
        payload: bytes,
        digest: str,
        rejection: errors.LorafleetError | None,
        *,
        bucket: bool = True,
    ) -> Admission:
        """Run the admission script, leasing its group what it runs short of (store/quota.py)
        between tries. `bucket=False` skips the tenant's admission bucket: the controller's
        own seq 0 load is part of a creation the registration limit governs, not a request a
        tenant can flood."""
        s = self.settings
        born = error_json(rejection) if rejection is not None else ""
        own = [self.keys.reg(registration_id), self.keys.op(operation_id(registration_id, seq_id))]
        group = self.keys.group_of(registration_id)
        limits = admission_limits(s, bucket)
        for _ in range(ADMIT_TRIES):
            now = self.clock()
            out = named(
                await self.store.scripts.run(
                    "submit",
                    own,
                    registration_id,
                    seq_id,
                    digest,
                    kind,
                    payload,
                    now,
                    tenant,
                    s.max_pending_per_registration,
                    born,
                    self.window,
                    limits.rate,
                    group=group,
                    coalesced=s.pipeline_submits,
                )
            )
            code = text(out["code"])
            if code != "need_lease":
                break
            needs = lease_needs(out)
            refusal = await self.quota.provide(tenant, group, needs, limits, registration_id, now)
            if refusal is not None:
                raise backpressure(refusal.scope, refusal.retry_after)
        else:
            raise backpressure(needs[0][0])
        if code in ("created", "duplicate"):
            return Admission(
                text(out["operation_id"]),
                OpState(int(out["state"])),
                code == "duplicate",
                text(out.get("page_in")),
            )
        if code == "not_found":
            raise errors.NotFound(f"no registration {registration_id!r}", field="registration_id")
        if code == "conflict":
            raise errors.Conflict(
                f"seq_id {seq_id} of {registration_id} was already used with a different "
                "payload (or was sealed as a gap)",
                field="seq_id",
                reason="PAYLOAD_CONFLICT",
            )
        if code == "retired":
            if failed := text(out.get("failed")):  # the trainer refused to bind it
                raise contract.run_failure(failed)
            if corrupted := text(out.get("corrupted")):  # recovery.py said what was lost
                raise errors.FailedPrecondition(
                    corrupted, field="registration_id", reason="RUN_CORRUPTED"
                )
            raise errors.FailedPrecondition(
                f"registration {registration_id} was retired",
                field="registration_id",
                reason="RETIRED",
            )
        if code == "released":
            raise errors.Expired(
                f"seq_id {seq_id} of {registration_id} ran and its result was released "
                f"(the head is at {int(out['head'])})",
                field="seq_id",
                reason="RESULT_RELEASED",
            )
        if code == "window":
            head = int(out["head"])
            raise errors.InvalidArgument(
                f"seq_id {seq_id} is outside the window [{head}, "
                f"{head + self.window - 1}] of {registration_id}",
                field="seq_id",
                reason="SEQ_OUT_OF_RANGE",
            )
        if code == "unavailable":
            raise errors.Unavailable(
                f"registration {registration_id} is unavailable: {text(out['reason'])}",
                field="registration_id",
                reason="REGISTRATION_UNAVAILABLE",
            )
        if code == "backpressure":
            raise backpressure(text(out["scope"]), float(text(out.get("retry_after"), "1")))
        raise errors.Internal(f"unexpected submit outcome {code!r}")

    # --- reads ----------------------------------------------------------------------------
    async def get(self, tenant: str, opid: str) -> OpRecord:
        op = await self.operations.load(opid) or await self.operations.released(opid)
        if op is None or op.tenant != tenant:
            raise errors.NotFound(f"no operation {opid!r}", field="operation_id")
        return await self._record(opid, op)

    async def get_any(self, opid: str) -> OpRecord | None:
        op = await self.operations.load(opid)
        return await self._record(opid, op) if op is not None else None

    async def _record(self, opid: str, op: StoredOp) -> OpRecord:
        state = op.state
        ttl_over = op.finished_at + self.settings.result_ttl_seconds < self.clock()
        if state in TERMINAL and state != OpState.EXPIRED and ttl_over:
            state = OpState.EXPIRED
        waiting, waiting_for = "", controller_pb2.WAITING_FOR_UNSPECIFIED
        if state == OpState.QUEUED and op.ordered:
            waiting, waiting_for = await self._waiting(op.registration_id, op.seq_id)
        elif state == OpState.QUEUED:
            waiting_for = controller_pb2.WAITING_FOR_DISPATCH
        elif state == OpState.CLAIMED:
            waiting_for = controller_pb2.WAITING_FOR_TRAINER
        expired = state == OpState.EXPIRED
        return OpRecord(
            operation_id=opid,
            registration_id=op.registration_id,
            tenant=op.tenant,
            seq_id=op.seq_id,
            kind=op.kind,
            state=state,
            payload=op.payload,
            result=b"" if expired else op.result,
            error=None if expired or not op.error else json.loads(op.error),
            submitted_at=op.submitted_at,
            finished_at=op.finished_at,
            waiting_reason=waiting,
            waiting_for=waiting_for,
            version=op.version,
        )

    async def _waiting(self, rid: str, seq: int) -> tuple[str, WaitingFor]:
        """Why a queued operation has not been claimed: text for people, a value for code."""
        reg = await self.operations.progress(rid)
        st = reg.state
        if st in (RegState.QUEUED, RegState.BINDING):
            return "waiting for a slot", controller_pb2.WAITING_FOR_SLOT
        if st in (RegState.PAGING, RegState.PAGED):
            return "paged out: waiting for a slot", controller_pb2.WAITING_FOR_SLOT
        if st == RegState.UNAVAILABLE:
            return (
                f"registration unavailable: {reg.unavailable_reason}",
                controller_pb2.WAITING_FOR_TRAINER,
            )
        h = reg.head
        if seq > h:
            exists = await self.operations.exists(operation_id(rid, h))
            return (
                f"waiting for seq_id {h}" + ("" if not exists else " to finish"),
                controller_pb2.WAITING_FOR_SEQUENCE,
            )
        return "", controller_pb2.WAITING_FOR_DISPATCH

    async def wait(self, tenant: str, opid: str, wait_seconds: float) -> OpRecord:
        """Long-poll: return as soon as the operation is terminal, or after `wait_seconds`."""
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            with self.notifier.watch(opid) as event:
                rec = await self.get(tenant, opid)
                remaining = deadline - time.monotonic()
                if rec.terminal or remaining <= 0:
                    return rec
                try:
                    async with asyncio.timeout(remaining):
                        await event.wait()
                except TimeoutError:
                    return await self.get(tenant, opid)

    async def ack(self, tenant: str, opid: str) -> None:
        """The client has the result: it stops counting toward the unacked limits now and
        is released `acked_result_grace_seconds` later (ack.lua says why)."""
        own = [self.keys.op(opid)]
        s = self.settings
        release_at = self.clock() + s.acked_result_grace_seconds - s.result_ttl_seconds
        out = await self.store.scripts.run(
            "ack", own, opid, tenant, release_at, group=self.keys.group_of_op(opid)
        )
        code = text(named(out)["code"])
        if code == "not_found":
            raise errors.NotFound(f"no operation {opid!r}", field="operation_id")
        if code == "open":
            raise errors.FailedPrecondition(
                f"operation {opid} has not finished; only results can be acknowledged",
                field="operation_id",
            )

    # --- dispatch side (`fenced`: the write carries the leader's epoch) ----------------------
    def _epoch(self, fenced: bool) -> int | None:
        return self.store.leader_epoch() if fenced else None

    async def claim(self, opid: str, *, fenced: bool = True) -> Claim | None:
        out = await self.store.scripts.run(
            "claim",
            [self.keys.op(opid)],
            opid,
            self.clock(),
            epoch=self._epoch(fenced),
            group=self.keys.group_of_op(opid),
        )
        return Claim.decode(out) if out else None

    async def claim_many(self, group: int, popped: Sequence[str], limit: int) -> list[Claim]:
        """Claim the ids popped from `group`'s ready queues and more ready ones of that group,
        up to `limit` ids, in one round trip."""
        own = [self.keys.op(opid) for opid in popped]
        out = await self.store.scripts.run(
            "claim_many",
            own,
            self.clock(),
            limit,
            *popped,
            epoch=self.store.leader_epoch(),
            group=group,
        )
        return [Claim.decode(row) for row in out]

    async def load_claim(self, opid: str) -> Claim | None:
        """The claim of an operation already CLAIMED (re-dispatch after a restart)."""
        fields = await self.operations.claim_fields(opid)
        return Claim.of(fields) if fields is not None else None

    async def complete(
        self,
        opid: str,
        state: OpState,
        result: bytes = b"",
        error: errors.LorafleetError | None = None,
        effects: Sequence[tuple[str, str, Any]] = (),
        *,
        claim: int = 0,
        fenced: bool = True,
    ) -> bool:
        """Record an outcome; `effects` update the registration in the same transaction."""
        (done,) = await self.complete_many(
            [Outcome(opid, state, result, error, effects, claim)], fenced=fenced
        )
        return done

    async def complete_many(
        self, outcomes: Sequence[Outcome], from_state: str = "claimed", *, fenced: bool = True
    ) -> list[bool]:
        """Record several outcomes (a data batch), one round trip per group they fall in,
        concurrently; True where recorded."""
        by_group: dict[int, list[int]] = {}
        for i, o in enumerate(outcomes):
            by_group.setdefault(self.keys.group_of_op(o.operation_id), []).append(i)
        epoch = self._epoch(fenced)
        now = self.clock()

        async def complete(group: int, indexes: list[int]) -> list[Any]:
            flat: list[Any] = []
            own: list[str] = []
            for o in (outcomes[i] for i in indexes):
                err = error_json(o.error) if o.error is not None else ""
                flat += [o.operation_id, int(o.state), o.result, err, from_state, o.claim]
                flat.append(len(o.effects))
                for op, field, value in o.effects:
                    flat += [op, field, value]
                own.append(self.keys.op(o.operation_id))
            return list(
                await self.store.scripts.run("complete", own, now, *flat, epoch=epoch, group=group)
            )

        groups = list(by_group.items())
        answers = await asyncio.gather(*(complete(g, indexes) for g, indexes in groups))
        done = [False] * len(outcomes)
        for (_, indexes), answer in zip(groups, answers, strict=True):
            for i, recorded in zip(indexes, answer, strict=True):
                done[i] = bool(recorded)
        return done

    async def fence(
        self,
        registration_id: str,
        new_state: RegState,
        error: errors.LorafleetError,
        reason: str = "",
    ) -> int:
        """Fail every open operation of a registration and move it to `new_state`."""
        out = named(
            await self.store.scripts.run(
                "fence",
                [self.keys.reg(registration_id)],
                registration_id,
                self.clock(),
                new_state.value,
                error_json(error),
                reason,
                group=self.keys.group_of(registration_id),
            )
        )
        if text(out["code"]) == "not_found":
            return -1
        return int(out["failed"])

    async def claimed_ids(self) -> list[str]:
        return await self.operations.claimed_ids()

    async def repush(self, registration_id: str) -> None:
        await self.store.scripts.run(
            "repush",
            [self.keys.reg(registration_id)],
            registration_id,
            self.clock(),
            epoch=self.store.leader_epoch(),
            group=self.keys.group_of(registration_id),
        )

    # --- housekeeping ---------------------------------------------------------------------
    async def sweep(self, limit: int = 500) -> Swept:
        """Fail stale claims, expire old results, seal old gaps, in every group at once.

        Also deletes the operation records of registrations retired longer ago than the
        result TTL, so Redis does not grow forever.
        """
        now = self.clock()
        s = self.settings
        epoch = self.store.leader_epoch()
        claimed_err = error_json(
            errors.Internal(
                f"no result within {s.claimed_timeout_seconds:g}s of being claimed",
                reason="CLAIM_TIMEOUT",
            )
        )
        cutoff = now - s.gap_timeout_seconds

        async def sweep_group(group: int) -> Swept:
            out = named(
                await self.store.scripts.run(
                    "sweep",
                    [],
                    now,
                    now - s.claimed_timeout_seconds,
                    now - s.result_ttl_seconds,
                    limit,
                    claimed_err,
                    epoch=epoch,
                    group=group,
                )
            )
            sealed = 0
            for rid in await self.operations.gaps_older_than(group, cutoff, limit):
                sealing = named(
                    await self.store.scripts.run(
                        "seal", [self.keys.reg(rid)], rid, now, cutoff, epoch=epoch, group=group
                    )
                )
                sealed += text(sealing["code"]) == "sealed"
            return Swept(int(out["claims_failed"]), int(out["results_expired"]), sealed)

        swept = await asyncio.gather(*(sweep_group(g) for g in range(self.keys.groups)))
        return Swept(
            sum(x.claims_failed for x in swept),
            sum(x.results_expired for x in swept),
            sum(x.gaps_sealed for x in swept),
        )

    async def depth(self) -> dict[str, int]:
        return {state.label: n for state, n in (await self.operations.depth()).items()}

    async def gap_stalls(self) -> int:
        return await self.operations.gap_stalls()

    async def fleet_load(self) -> dict[str, int]:
        """The fleet's open operations and unacknowledged results, and their bytes (summed
        over the groups)."""
        return await self.quota.load("")

    async def tenant_load(self, tenant: str) -> dict[str, int]:
        """A tenant's open operations and unacknowledged results, and their bytes (summed
        over the groups), and its live registrations."""
        live = await self.operations.live_registrations(tenant)
        return {**await self.quota.load(tenant), "registrations": live}


def admission_limits(s: ControllerSettings, bucket: bool = True) -> Limits:
    """The tenant's and the fleet's limits an admission is held to; `bucket` False spends no
    admission tokens (samples, the controller's own seq 0 load)."""
    return Limits(
        pending_per_tenant=s.max_pending_per_tenant,
        pending_global=s.max_pending_global,
        unacked_per_tenant=s.max_unacked_results_per_tenant,
        unacked_global=s.max_unacked_results,
        pending_bytes_per_tenant=s.max_pending_bytes_per_tenant,
        pending_bytes_global=s.max_pending_bytes_global,
        unacked_bytes_per_tenant=s.max_unacked_bytes_per_tenant,
        unacked_bytes_global=s.max_unacked_bytes_global,
        rate=s.admission_rate_per_tenant if bucket else 0.0,
        burst=s.admission_burst_per_tenant,
    )


def check_size(size: int, s: ControllerSettings, field: str) -> None:
    """A payload no admission could ever take is the caller's error, not backpressure:
    larger than MAX_PAYLOAD_BYTES, or than all the payload bytes a tenant (or the fleet) may
    have open at once."""
    for name in ("max_payload_bytes", "max_pending_bytes_per_tenant", "max_pending_bytes_global"):
        limit = getattr(s, name)
        if size > limit:
            raise errors.InvalidArgument(
                f"{field} is {size} bytes, over the {limit}-byte limit "
                f"LORAFLEET_CONTROLLER_{name.upper()}",
                field=field,
                reason="PAYLOAD_TOO_LARGE",
            )


def backpressure(scope: str, retry_after: float = 1.0) -> errors.ResourceExhausted:
    """The retryable refusal of a submission over one of its limits (nothing was written).

    `retry_after` is 1 s for the count limits (they free up as operations finish, at no
    known time) and, for the admission bucket, when it is half full again (submit.lua)."""
    metrics.BACKPRESSURE.labels(scope=scope).inc()
    return errors.ResourceExhausted(
        f"too many {BACKPRESSURE_SCOPES.get(scope, scope)}; nothing was admitted, retry the "
        "same seq_id",
        retry_after=retry_after,
        field="seq_id",
        reason="BACKPRESSURE",
    )
