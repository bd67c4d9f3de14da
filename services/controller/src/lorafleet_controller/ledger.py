"""The operation ledger: per-registration ordered, idempotent, durable operations in Redis.

Semantics copied from the miles ledger (design-lessons §3) and made durable: every state
transition is one Lua script (`scripts/*.lua`), so a controller killed at any instant leaves
either the old or the new state, never half of one. Operation ids are derived from the
identity the client already has, `<registration_id>#<seq_id>`, so a retried submission lands
on its original record without any lookup table.

States: QUEUED → CLAIMED → SUCCEEDED | FAILED(user|server) | CANCELLED, then EXPIRED once the
result is acknowledged or outlives `result_ttl_seconds`; the seq_id stays reserved forever.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet_controller import metrics
from lorafleet_controller.lua import Scripts
from lorafleet_controller.notify import Notifier
from lorafleet_controller.settings import ControllerSettings

QUEUED, CLAIMED, SUCCEEDED, FAILED, CANCELLED, EXPIRED = 1, 2, 3, 4, 5, 6
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, EXPIRED})
STATE_NAMES = {
    QUEUED: "queued", CLAIMED: "claimed", SUCCEEDED: "succeeded", FAILED: "failed",
    CANCELLED: "cancelled", EXPIRED: "expired",
}  # fmt: skip


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


def _s(value: bytes | None, default: str = "") -> str:
    return value.decode() if value is not None else default


@dataclass(frozen=True)
class Admission:
    operation_id: str
    state: int
    duplicate: bool


@dataclass(frozen=True)
class OpRecord:
    operation_id: str
    registration_id: str
    tenant: str
    seq_id: int
    kind: int
    state: int
    payload: bytes
    result: bytes
    error: dict[str, str] | None
    submitted_at: float
    finished_at: float
    waiting_reason: str
    version: int

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class Outcome:
    """What became of one claimed operation, for `Ledger.complete_many`."""

    operation_id: str
    state: int
    result: bytes = b""
    error: errors.LorafleetError | None = None
    effects: Sequence[tuple[str, str, Any]] = ()


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


class Ledger:
    """Admission, claims, outcomes, acknowledgement and housekeeping of operations."""

    def __init__(
        self,
        client: aioredis.Redis,
        scripts: Scripts,
        settings: ControllerSettings,
        notifier: Notifier,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.r = client
        self.scripts = scripts
        self.settings = settings
        self.notifier = notifier
        self.clock = clock
        self.p = settings.key_prefix
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
        if len(payload) > s.max_payload_bytes:
            raise errors.InvalidArgument(
                f"payload is {len(payload)} bytes, over the {s.max_payload_bytes}-byte limit",
                field="payload",
                reason="PAYLOAD_TOO_LARGE",
            )
        return await self._admit(tenant, registration_id, seq_id, kind, payload, digest, rejection)

    async def create_internal(
        self, registration_id: str, tenant: str, seq_id: int, kind: int, payload: bytes
    ) -> str:
        """Admit a controller-made operation (the seq 0 load of create-via-load)."""
        adm = await self._admit(
            tenant, registration_id, seq_id, kind, payload, f"internal:{kind}", None
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
    ) -> Admission:
        s = self.settings
        born = error_json(rejection) if rejection is not None else ""
        run = self.scripts.run_coalesced if s.pipeline_submits else self.scripts.run
        out = await run(
            "submit", registration_id, seq_id, digest, kind, payload, self.clock(), tenant,
            s.max_pending_per_registration, s.max_unacked_results, s.max_pending_global,
            born, self.window,
        )  # fmt: skip
        code = _s(out[0])
        if code in ("created", "duplicate"):
            return Admission(_s(out[1]), int(out[2]), code == "duplicate")
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
            raise errors.FailedPrecondition(
                f"registration {registration_id} was retired", field="registration_id",
                reason="RETIRED",
            )  # fmt: skip
        if code == "window":
            head = int(out[1])
            raise errors.InvalidArgument(
                f"seq_id {seq_id} is outside the window [{head}, "
                f"{head + self.window - 1}] of {registration_id}",
                field="seq_id",
                reason="SEQ_OUT_OF_RANGE",
            )
        if code == "unavailable":
            raise errors.Unavailable(
                f"registration {registration_id} is unavailable: {_s(out[1])}",
                field="registration_id",
                reason="REGISTRATION_UNAVAILABLE",
            )
        if code == "backpressure":
            scope = _s(out[1])
            metrics.BACKPRESSURE.labels(scope=scope).inc()
            raise errors.ResourceExhausted(
                f"too many {'unacknowledged results' if scope == 'results' else 'open operations'}"
                f" ({scope}); nothing was admitted, retry the same seq_id",
                retry_after=1.0,
                field="seq_id",
                reason="BACKPRESSURE",
            )
        raise errors.Internal(f"unexpected submit outcome {code!r}")

    # --- reads ----------------------------------------------------------------------------
    async def get(self, tenant: str, opid: str) -> OpRecord:
        raw = await self.r.hgetall(f"{self.p}op:{opid}")
        if not raw or _s(raw.get(b"tenant")) != tenant:
            raise errors.NotFound(f"no operation {opid!r}", field="operation_id")
        return await self._record(opid, raw)

    async def get_any(self, opid: str) -> OpRecord | None:
        raw = await self.r.hgetall(f"{self.p}op:{opid}")
        return await self._record(opid, raw) if raw else None

    async def _record(self, opid: str, raw: dict[bytes, bytes]) -> OpRecord:
        state = int(raw[b"state"])
        finished = float(raw.get(b"finished_at", b"0"))
        ttl_over = finished + self.settings.result_ttl_seconds < self.clock()
        if state in TERMINAL and state != EXPIRED and ttl_over:
            state = EXPIRED
        rid = _s(raw.get(b"rid"))
        seq = int(raw.get(b"seq", b"0"))
        waiting = ""
        if state == QUEUED and raw.get(b"ordered") == b"1":
            waiting = await self._waiting_reason(rid, seq)
        err = raw.get(b"error")
        expired = state == EXPIRED
        return OpRecord(
            operation_id=opid,
            registration_id=rid,
            tenant=_s(raw.get(b"tenant")),
            seq_id=seq,
            kind=int(raw.get(b"kind", b"0")),
            state=state,
            payload=raw.get(b"payload", b""),
            result=b"" if expired else raw.get(b"result", b""),
            error=None if expired or not err else json.loads(err),
            submitted_at=float(raw.get(b"submitted_at", b"0")),
            finished_at=finished,
            waiting_reason=waiting,
            version=int(raw.get(b"version", b"0")),
        )

    async def _waiting_reason(self, rid: str, seq: int) -> str:
        state, head, reason = await self.r.hmget(
            f"{self.p}reg:{rid}", "state", "head", "unavailable_reason"
        )
        st = _s(state)
        if st in ("queued", "binding"):
            return "waiting for a slot"
        if st == "unavailable":
            return f"registration unavailable: {_s(reason)}"
        h = int(head or 0)
        if seq > h:
            exists = await self.r.exists(f"{self.p}op:{operation_id(rid, h)}")
            return f"waiting for seq_id {h}" + ("" if not exists else " to finish")
        return ""

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
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    return await self.get(tenant, opid)

    async def ack(self, tenant: str, opid: str) -> None:
        code = _s(await self.scripts.run("ack", opid, tenant))
        if code == "not_found":
            raise errors.NotFound(f"no operation {opid!r}", field="operation_id")
        if code == "open":
            raise errors.FailedPrecondition(
                f"operation {opid} has not finished; only results can be acknowledged",
                field="operation_id",
            )

    # --- dispatch side --------------------------------------------------------------------
    async def claim(self, opid: str) -> Claim | None:
        out = await self.scripts.run("claim", opid, self.clock())
        return _claim(opid, out) if out else None

    async def claim_many(self, popped: Sequence[str], limit: int) -> list[Claim]:
        """Claim the popped ids and more ready ones, up to `limit` ids, in one round trip."""
        out = await self.scripts.run("claim_many", self.clock(), limit, *popped)
        return [_claim(_s(out[i]), out[i + 1 : i + 11]) for i in range(0, len(out), 11)]

    async def load_claim(self, opid: str) -> Claim | None:
        """The claim of an operation already CLAIMED (re-dispatch after a restart)."""
        raw = await self.r.hmget(
            f"{self.p}op:{opid}", "state", "rid", "seq", "kind", "payload", "tenant", "submitted_at"
        )
        if raw[0] is None or int(raw[0]) != CLAIMED:
            return None
        reg = await self.r.hmget(f"{self.p}reg:{_s(raw[1])}", "replica", "slot", "dirty",
                                 "base_model")  # fmt: skip
        return _claim(opid, [raw[1], raw[2], raw[3], raw[4], reg[0], reg[1], reg[2], reg[3],
                             raw[5], raw[6]])  # fmt: skip

    async def complete(
        self,
        opid: str,
        state: int,
        result: bytes = b"",
        error: errors.LorafleetError | None = None,
        effects: Sequence[tuple[str, str, Any]] = (),
        from_state: str = "claimed",
    ) -> bool:
        """Record an outcome; `effects` update the registration in the same transaction."""
        (done,) = await self.complete_many([Outcome(opid, state, result, error, effects)],
                                           from_state)  # fmt: skip
        return done

    async def complete_many(
        self, outcomes: Sequence[Outcome], from_state: str = "claimed"
    ) -> list[bool]:
        """Record several outcomes in one round trip (a data batch); True where recorded."""
        flat: list[Any] = []
        for o in outcomes:
            err = error_json(o.error) if o.error is not None else ""
            flat += [o.operation_id, o.state, o.result, err, from_state, len(o.effects)]
            for op, field, value in o.effects:
                flat += [op, field, value]
        done = await self.scripts.run("complete", self.clock(), *flat)
        return [bool(x) for x in done]

    async def set_field(self, opid: str, field: str, value: Any) -> None:
        await self.r.hset(f"{self.p}op:{opid}", field, value)

    async def fence(
        self, registration_id: str, new_state: str, error: errors.LorafleetError, reason: str = ""
    ) -> int:
        return int(
            await self.scripts.run(
                "fence", registration_id, self.clock(), new_state, error_json(error), reason
            )
        )

    async def claimed_ids(self) -> list[str]:
        return [_s(x) for x in await self.r.zrange(f"{self.p}claimed", 0, -1)]

    async def repush(self, registration_id: str) -> None:
        await self.scripts.run("repush", registration_id, self.clock())

    # --- housekeeping ---------------------------------------------------------------------
    async def sweep(self, limit: int = 500) -> tuple[int, int, int]:
        """Fail stale claims, expire old results, seal old gaps. Returns the three counts.

        Also deletes the operation records of registrations retired longer ago than the
        result TTL, so Redis does not grow forever.
        """
        now = self.clock()
        s = self.settings
        claimed_err = error_json(
            errors.Internal(
                f"no result within {s.claimed_timeout_seconds:g}s of being claimed",
                reason="CLAIM_TIMEOUT",
            )
        )
        failed, expired, _deleted = await self.scripts.run(
            "sweep", now, now - s.claimed_timeout_seconds, now - s.result_ttl_seconds, limit,
            claimed_err,
        )  # fmt: skip
        sealed = 0
        cutoff = now - s.gap_timeout_seconds
        for rid in await self.r.zrangebyscore(f"{self.p}gaps", "-inf", cutoff, 0, limit):
            if int(await self.scripts.run("seal", _s(rid), now, cutoff)) >= 0:
                sealed += 1
        return int(failed), int(expired), sealed

    async def depth(self) -> dict[str, int]:
        raw = await self.r.hgetall(f"{self.p}depth")
        return {STATE_NAMES.get(int(k), _s(k)): int(v) for k, v in raw.items()}

    async def gap_stalls(self) -> int:
        return int(await self.r.zcard(f"{self.p}gaps"))


def _claim(opid: str, out: Sequence[Any]) -> Claim:
    slot = _s(out[5])
    return Claim(
        operation_id=opid,
        registration_id=_s(out[0]),
        seq_id=int(out[1]),
        kind=int(out[2]),
        payload=out[3] or b"",
        replica=_s(out[4]),
        slot=int(slot) if slot not in ("", "-1") else -1,
        dirty=_s(out[6]) == "1",
        base_model=_s(out[7]),
        tenant=_s(out[8]),
        submitted_at=float(out[9] or 0),
    )
