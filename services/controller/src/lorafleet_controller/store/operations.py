"""The operations' records in Redis: what the ledger (ledger.py) reads outside its scripts.

Every ledger transition is a script (`store.scripts`); the reads here are an operation's
record (`op`), what a queued operation waits for on its registration (`reg`: state, head),
the CLAIMED index (`claimed`), the registrations stalled on a missing seq_id (`gaps`) and the
operations per state (`depth`), each kept per group and read over all of them, and a
tenant's live registrations. They return typed values; what they mean (an expired result,
why an operation waits) is the ledger's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet_controller.store import OpState, RegState, Store, blob, text


@dataclass(frozen=True)
class StoredOp:
    """An operation's record as stored (`error` is its JSON, '' without one)."""

    registration_id: str
    tenant: str
    seq_id: int
    kind: int
    state: OpState
    payload: bytes
    result: bytes
    error: str
    submitted_at: float
    finished_at: float
    ordered: bool  # queued behind the registration's earlier seq_ids
    version: int


@dataclass(frozen=True)
class RegProgress:
    """Where a registration's ledger stands: its state, its head seq_id and, when
    unavailable, why."""

    state: str
    head: int
    unavailable_reason: str


class OperationsRepo:
    """The ledger's reads of the operation family and its indexes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def load(self, opid: str) -> StoredOp | None:
        raw = await self.store.redis.hgetall(self.keys.op(opid))
        if not raw:
            return None
        err = raw.get(b"error")
        return StoredOp(
            registration_id=text(raw.get(b"rid")),
            tenant=text(raw.get(b"tenant")),
            seq_id=int(raw.get(b"seq", b"0")),
            kind=int(raw.get(b"kind", b"0")),
            state=OpState(int(raw[b"state"])),
            payload=blob(raw.get(b"payload")),
            result=blob(raw.get(b"result")),
            error=text(err) if err else "",
            submitted_at=float(raw.get(b"submitted_at", b"0")),
            finished_at=float(raw.get(b"finished_at", b"0")),
            ordered=raw.get(b"ordered") == b"1",
            version=int(raw.get(b"version", b"0")),
        )

    async def released(self, opid: str) -> StoredOp | None:
        """The EXPIRED record of an ordered operation whose record was compacted
        (store/lua/common.lua's `compactable`): a seq_id below its registration's head, or
        up to the last one of a retired registration, with no record. None for any other id
        (a sample's record leaves nothing behind)."""
        rid, sep, seq_text = opid.rpartition("#")
        if not sep or not seq_text.isdigit():
            return None
        seq = int(seq_text)
        tenant, state, head, max_seq = await self.store.redis.hmget(
            self.keys.reg(rid), "tenant", "state", "head", "max_seq"
        )
        if tenant is None:
            return None
        below = seq < int(head or 0) or (
            text(state) == RegState.RETIRED and seq <= int(max_seq or -1)
        )
        if not below or await self.exists(opid):
            return None
        return StoredOp(rid, text(tenant), seq, 0, OpState.EXPIRED, b"", b"", "", 0, 0, True, 0)

    async def exists(self, opid: str) -> bool:
        return bool(await self.store.redis.exists(self.keys.op(opid)))

    async def progress(self, rid: str) -> RegProgress:
        state, head, reason = await self.store.redis.hmget(
            self.keys.reg(rid), "state", "head", "unavailable_reason"
        )
        return RegProgress(text(state), int(head or 0), text(reason))

    async def claim_fields(self, opid: str) -> dict[str, Any] | None:
        """A CLAIMED operation's claim, by the names `claim_op` returns them
        (store/lua/common.lua); None unless the operation is CLAIMED."""
        redis = self.store.redis
        fields = ("state", "rid", "seq", "kind", "payload", "tenant", "submitted_at", "claim")
        op = dict(zip(fields, await redis.hmget(self.keys.op(opid), *fields), strict=True))
        if op["state"] is None or int(op["state"]) != OpState.CLAIMED:
            return None
        reg_fields = ("replica", "slot", "dirty", "base_model")
        reg = dict(
            zip(
                reg_fields,
                await redis.hmget(self.keys.reg(text(op["rid"])), *reg_fields),
                strict=True,
            )
        )
        return {
            "operation_id": opid,
            "registration_id": op["rid"],
            "seq_id": op["seq"],
            "kind": op["kind"],
            "payload": blob(op["payload"]),
            "tenant": op["tenant"],
            "submitted_at": op["submitted_at"],
            "claim": op["claim"],
            **reg,
        }

    async def claimed_ids(self) -> list[str]:
        """Every CLAIMED operation, group after group."""
        ids: list[str] = []
        for group in self.keys.all_groups():
            ids += [text(x) for x in await self.store.redis.zrange(group.claimed, 0, -1)]
        return ids

    async def gaps_older_than(self, group: int, cutoff: float, limit: int) -> list[str]:
        """Up to `limit` registrations of `group` stalled on a missing seq_id since `cutoff`
        or before."""
        gaps = self.keys.group(group).gaps
        raw = await self.store.redis.zrangebyscore(gaps, "-inf", cutoff, 0, limit)
        return [text(x) for x in raw]

    async def gap_stalls(self) -> int:
        return sum([int(await self.store.redis.zcard(g.gaps)) for g in self.keys.all_groups()])

    async def depth(self) -> dict[OpState, int]:
        """The fleet's operations per state (summed over the groups)."""
        total: dict[OpState, int] = {}
        for group in self.keys.all_groups():
            for k, v in (await self.store.redis.hgetall(group.depth)).items():
                state = OpState(int(k))
                total[state] = total.get(state, 0) + int(v)
        return total

    async def live_registrations(self, tenant: str) -> int:
        return int(await self.store.redis.scard(self.keys.tenant_live(tenant)))
