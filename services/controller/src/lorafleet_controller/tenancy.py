"""Tenants' API keys and sessions, in Redis.

API keys are `tml-` + 43 url-safe characters; only their SHA-256 is stored (a leaked Redis
dump reveals no usable key). Sessions are opaque ids owned by one tenant; every lookup of a
session, like every other id in the controller, answers NotFound for another tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from lorafleet import errors
from lorafleet_controller.store import Store, text

KEY_PREFIX = "tml-"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    label: str
    created_at: float
    revoked: bool


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


class Tenancy:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.keys = store.keys
        self.clock = clock

    # --- API keys -------------------------------------------------------------------------
    async def create_key(self, tenant: str, label: str) -> tuple[str, str]:
        """A new key for `tenant`: (plaintext, key_id). The plaintext is never stored."""
        if not tenant:
            raise errors.InvalidArgument("tenant is required", field="tenant")
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "key-" + secrets.token_hex(8)
        digest = hash_key(api_key)
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.keys.api_key(key_id),
                mapping={
                    "tenant": tenant,
                    "label": label,
                    "created_at": self.clock(),
                    "revoked": "0",
                    "hash": digest,
                },
            )
            pipe.set(self.keys.key_hash(digest), key_id)
            pipe.sadd(self.keys.tenant_keys(tenant), key_id)
            await pipe.execute()
        return api_key, key_id

    async def authenticate(self, api_key: str) -> tuple[str, str]:
        """(tenant, key_id) of a valid, unrevoked key; PermissionDenied otherwise."""
        denied = errors.PermissionDenied("invalid or revoked API key", field="api_key")
        if not api_key.startswith(KEY_PREFIX):
            raise denied
        digest = hash_key(api_key)
        key_id = await self.store.redis.get(self.keys.key_hash(digest))
        if key_id is None:
            raise denied
        tenant, revoked, stored = await self.store.redis.hmget(
            self.keys.api_key(text(key_id)), "tenant", "revoked", "hash"
        )
        if stored is None or not hmac.compare_digest(text(stored), digest) or revoked == b"1":
            raise denied
        return text(tenant), text(key_id)

    async def list_keys(self, tenant: str) -> list[ApiKey]:
        ids = sorted(
            text(i) for i in await self.store.redis.smembers(self.keys.tenant_keys(tenant))
        )
        out = []
        for key_id in ids:
            raw = await self.store.redis.hgetall(self.keys.api_key(key_id))
            if raw:
                out.append(
                    ApiKey(
                        key_id,
                        text(raw[b"tenant"]),
                        text(raw.get(b"label")),
                        float(raw[b"created_at"]),
                        raw.get(b"revoked") == b"1",
                    )
                )
        return out

    async def revoke_key(self, key_id: str) -> None:
        key = self.keys.api_key(key_id)
        if not await self.store.redis.exists(key):
            raise errors.NotFound(f"no API key {key_id!r}", field="key_id")
        await self.store.redis.hset(key, "revoked", "1")

    async def sessions_of_key(self, key_id: str) -> list[tuple[str, str]]:
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

    # --- sessions -------------------------------------------------------------------------
    async def create_session(
        self,
        tenant: str,
        tags: list[str],
        user_metadata: dict[str, str],
        sdk_version: str,
        project_id: str,
        display_name: str,
        key_id: str = "",
    ) -> str:
        """A new live session. `key_id`: the API key that opened it (the gateway's caller),
        so revoking that key ends it; sessions the controller opens itself have none."""
        if not tenant:
            raise errors.InvalidArgument("tenant is required", field="tenant")
        if key_id and await self.store.redis.hget(self.keys.api_key(key_id), "revoked") == b"1":
            raise errors.PermissionDenied("invalid or revoked API key", field="api_key")
        session_id = f"session-{uuid.uuid4().hex}"
        now = self.clock()
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.keys.session(session_id),
                mapping={
                    "tenant": tenant,
                    "tags": json.dumps(tags),
                    "metadata": json.dumps(user_metadata, sort_keys=True),
                    "sdk_version": sdk_version,
                    "project_id": project_id,
                    "display_name": display_name,
                    "created_at": now,
                    "finished": "0",
                    "last_heartbeat": now,
                    "key_id": key_id,
                },
            )
            if key_id:
                pipe.sadd(self.keys.key_sessions(key_id), session_id)
            pipe.zadd(self.keys.tenant_sessions(tenant), {session_id: now})
            pipe.zadd(self.keys.sessions_live, {session_id: now})
            await pipe.execute()
        return session_id

    async def check_session(self, tenant: str, session_id: str) -> None:
        owner = await self.store.redis.hget(self.keys.session(session_id), "tenant")
        if owner is None or text(owner) != tenant:
            raise errors.NotFound(f"no session {session_id!r}", field="session_id")

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        await self.check_session(tenant, session_id)
        if await self.store.redis.hget(self.keys.session(session_id), "finished") == b"1":
            raise errors.Expired(f"session {session_id} is finished", field="session_id")
        now = self.clock()
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.session(session_id), "last_heartbeat", now)
            pipe.zadd(self.keys.sessions_live, {session_id: now}, xx=True)
            await pipe.execute()

    async def silent_sessions(self, idle_seconds: float) -> list[tuple[str, str]]:
        """(tenant, session_id) of live sessions with no heartbeat for `idle_seconds`."""
        cutoff = self.clock() - idle_seconds
        ids = [
            text(raw)
            for raw in await self.store.redis.zrangebyscore(self.keys.sessions_live, "-inf", cutoff)
        ]
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hget(self.keys.session(session_id), "tenant")
            tenants = await pipe.execute()
        return [(text(t), session_id) for t, session_id in zip(tenants, ids, strict=True)]

    async def finish(self, tenant: str, session_id: str, reason: str) -> None:
        await self.check_session(tenant, session_id)
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.keys.session(session_id), mapping={"finished": "1", "finish_reason": reason}
            )
            pipe.zrem(self.keys.sessions_live, session_id)
            await pipe.execute()

    async def training_runs(self, session_id: str) -> list[str]:
        return sorted(
            text(x) for x in await self.store.redis.smembers(self.keys.session_runs(session_id))
        )

    async def get(self, tenant: str, session_id: str) -> Session:
        await self.check_session(tenant, session_id)
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

    async def list(self, tenant: str, limit: int, offset: int) -> tuple[list[str], int]:
        key = self.keys.tenant_sessions(tenant)
        total = int(await self.store.redis.zcard(key))
        stop = offset + (limit if limit > 0 else 100) - 1
        return [text(x) for x in await self.store.redis.zrevrange(key, offset, stop)], total
