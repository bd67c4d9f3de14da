"""The sessions' records in Redis: every read and write of the session family (tenancy.py).

A session is a hash (`session`) owned by one tenant; `tenant_sessions` lists a tenant's
sessions by creation time, `sessions_live` the unfinished ones by last heartbeat (what the
sweeper scans for silent ones), `sessions_finished` the finished ones by finish time (what
the sweeper expires), and `key_sessions` the unfinished sessions an API key opened (ended
when it is revoked). The registry and the samplers add to a session's `session_runs` and
`session_samplers`; they are read here.

Every write that touches more than one key, or checks before it writes, is one script:
`session_create` (refused when the opening key is revoked), `session_heartbeat` (only a live
session of that tenant), `session_finish` (only the tenant's own session) and
`session_expire` (only a finished one; the leader's, fenced). A session of
another tenant reads as absent, like every other id in the controller.

Fencing: creating and heartbeating are requests any replica serves, never fenced. Finishing
carries the epoch of a controller that leads (`Store.epoch`): the sweeper's expiry of silent
sessions and a managed job's end are leader work, refused (StaleEpoch) once a newer leader
took over, so a deposed leader cannot finish a session that the new one still hears from. A
standby serving FinishSession holds no epoch and finishes it unfenced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from lorafleet_controller.store import Store, named, text


@dataclass(frozen=True)
class Session:
    session_id: str
    tenant: str
    user_metadata: dict[str, str]
    tags: list[str]
    display_name: str
    finished: bool
    created_at: float
    training_run_ids: list[str]
    sampler_ids: list[str]


class Heartbeat(Enum):
    """A heartbeat's outcome: recorded, no such session of the tenant, or already finished."""

    OK = "ok"
    NOT_FOUND = "not_found"
    FINISHED = "finished"


class SessionsRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def create(
        self,
        session_id: str,
        tenant: str,
        key_id: str,
        now: float,
        *,
        tags: list[str],
        user_metadata: dict[str, str],
        sdk_version: str,
        project_id: str,
        display_name: str,
    ) -> bool:
        """Open a live session; False (nothing written) when `key_id` is revoked."""
        own = [self.keys.session(session_id), self.keys.tenant_sessions(tenant)]
        if key_id:
            own += [self.keys.api_key(key_id), self.keys.key_sessions(key_id)]
        out = named(
            await self.store.scripts.run(
                "session_create",
                own,
                session_id,
                tenant,
                key_id,
                now,
                json.dumps(tags),
                json.dumps(user_metadata, sort_keys=True),
                sdk_version,
                project_id,
                display_name,
            )
        )
        return text(out["code"]) == "created"

    async def owner(self, session_id: str) -> str | None:
        """The tenant owning the session; None when there is none."""
        owner = await self.store.redis.hget(self.keys.session(session_id), "tenant")
        return None if owner is None else text(owner)

    async def heartbeat(self, tenant: str, session_id: str, now: float) -> Heartbeat:
        out = named(
            await self.store.scripts.run(
                "session_heartbeat", [self.keys.session(session_id)], session_id, tenant, now
            )
        )
        return Heartbeat(text(out["code"]))

    async def finish(self, tenant: str, session_id: str, reason: str, now: float) -> bool:
        """Mark the tenant's session finished (fenced while this controller leads, see the
        module's docstring); False when it has no such session."""
        out = named(
            await self.store.scripts.run(
                "session_finish",
                [self.keys.session(session_id)],
                session_id,
                tenant,
                reason,
                now,
                epoch=self.store.epoch,
            )
        )
        return text(out["code"]) == "finished"

    async def finished_before(self, cutoff: float, limit: int) -> list[str]:
        """Up to `limit` sessions finished at or before `cutoff`, oldest first."""
        raw = await self.store.redis.zrangebyscore(
            self.keys.sessions_finished, "-inf", cutoff, start=0, num=limit
        )
        return [text(x) for x in raw]

    async def expire(self, session_id: str, now: float) -> bool:
        """Forget a finished session's records and its samplers (the leader's sweep:
        fenced)."""
        out = named(
            await self.store.scripts.run(
                "session_expire",
                [self.keys.session(session_id)],
                session_id,
                now,
                epoch=self.store.leader_epoch(),
            )
        )
        return text(out["code"]) == "expired"

    async def silent(self, cutoff: float) -> list[tuple[str, str]]:
        """(tenant, session_id) of live sessions whose last heartbeat is at or before
        `cutoff`."""
        ids = [
            text(raw)
            for raw in await self.store.redis.zrangebyscore(self.keys.sessions_live, "-inf", cutoff)
        ]
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hget(self.keys.session(session_id), "tenant")
            tenants = await pipe.execute()
        return [(text(t), session_id) for t, session_id in zip(tenants, ids, strict=True)]

    async def opened_with(self, key_id: str) -> list[tuple[str, str]]:
        """(tenant, session_id) of the unfinished sessions opened with `key_id`."""
        opened = await self.store.redis.smembers(self.keys.key_sessions(key_id))
        ids = sorted(text(x) for x in opened)
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self.keys.session(session_id), "tenant", "finished")
            rows = await pipe.execute()
        return [
            (text(tenant), sid)
            for (tenant, finished), sid in zip(rows, ids, strict=True)
            if tenant is not None and finished != b"1"
        ]

    async def training_runs(self, session_id: str) -> list[str]:
        return sorted(
            text(x) for x in await self.store.redis.smembers(self.keys.session_runs(session_id))
        )

    async def load(self, tenant: str, session_id: str) -> Session:
        """The session with its runs and samplers (the caller checked that `tenant` owns
        it)."""
        raw = await self.store.redis.hgetall(self.keys.session(session_id))
        runs = await self.training_runs(session_id)
        samplers = sorted(
            text(x) for x in await self.store.redis.smembers(self.keys.session_samplers(session_id))
        )
        return Session(
            session_id=session_id,
            tenant=tenant,
            user_metadata=json.loads(raw.get(b"metadata", b"{}")),
            tags=json.loads(raw.get(b"tags", b"[]")),
            display_name=text(raw.get(b"display_name")),
            finished=raw.get(b"finished") == b"1",
            created_at=float(raw.get(b"created_at", b"0")),
            training_run_ids=runs,
            sampler_ids=samplers,
        )

    async def page(self, tenant: str, offset: int, count: int) -> tuple[list[str], int]:
        """`count` of the tenant's session ids from `offset`, newest first, and how many it
        has in all."""
        key = self.keys.tenant_sessions(tenant)
        total = int(await self.store.redis.zcard(key))
        ids = await self.store.redis.zrevrange(key, offset, offset + count - 1)
        return [text(x) for x in ids], total
