"""Tenants' API keys and sessions: the rules; their records live in `store/api_keys.py` and
`store/sessions.py`.

API keys are `tml-` + 43 url-safe characters; only their SHA-256 is stored (a leaked Redis
dump reveals no usable key). Sessions are opaque ids owned by one tenant; every lookup of a
session, like every other id in the controller, answers NotFound for another tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import Callable

from lorafleet import errors
from lorafleet_controller.store import Store
from lorafleet_controller.store.api_keys import ApiKey, ApiKeysRepo
from lorafleet_controller.store.sessions import Heartbeat, Session, SessionsRepo

__all__ = ["KEY_PREFIX", "ApiKey", "Session", "Tenancy", "hash_key"]

KEY_PREFIX = "tml-"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class Tenancy:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.api_keys = ApiKeysRepo(store)
        self.sessions = SessionsRepo(store)
        self.room = store.room
        self.clock = clock

    # --- API keys -------------------------------------------------------------------------
    async def create_key(self, tenant: str, label: str) -> tuple[str, str]:
        """A new key for `tenant`: (plaintext, key_id). The plaintext is never stored."""
        if not tenant:
            raise errors.InvalidArgument("tenant is required", field="tenant")
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "key-" + secrets.token_hex(8)
        await self.api_keys.create(key_id, tenant, label, self.clock(), hash_key(api_key))
        return api_key, key_id

    async def authenticate(self, api_key: str) -> tuple[str, str]:
        """(tenant, key_id) of a valid, unrevoked key; PermissionDenied otherwise."""
        denied = errors.PermissionDenied("invalid or revoked API key", field="api_key")
        if not api_key.startswith(KEY_PREFIX):
            raise denied
        digest = hash_key(api_key)
        found = await self.api_keys.by_digest(digest)
        if found is None or not hmac.compare_digest(found.digest, digest) or found.revoked:
            raise denied
        return found.tenant, found.key_id

    async def list_keys(self, tenant: str) -> list[ApiKey]:
        return await self.api_keys.of_tenant(tenant)

    async def revoke_key(self, key_id: str) -> None:
        if not await self.api_keys.revoke(key_id):
            raise errors.NotFound(f"no API key {key_id!r}", field="key_id")

    async def sessions_of_key(self, key_id: str) -> list[tuple[str, str]]:
        """(tenant, session_id) of the unfinished sessions opened with `key_id`."""
        return await self.sessions.opened_with(key_id)

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
        self.room.admit("session")
        session_id = f"session-{uuid.uuid4().hex}"
        created = await self.sessions.create(
            session_id,
            tenant,
            key_id,
            self.clock(),
            tags=tags,
            user_metadata=user_metadata,
            sdk_version=sdk_version,
            project_id=project_id,
            display_name=display_name,
        )
        if not created:
            raise errors.PermissionDenied("invalid or revoked API key", field="api_key")
        return session_id

    async def check_session(self, tenant: str, session_id: str) -> None:
        if await self.sessions.owner(session_id) != tenant:
            raise _no_session(session_id)

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        outcome = await self.sessions.heartbeat(tenant, session_id, self.clock())
        if outcome is Heartbeat.NOT_FOUND:
            raise _no_session(session_id)
        if outcome is Heartbeat.FINISHED:
            raise errors.Expired(f"session {session_id} is finished", field="session_id")

    async def silent_sessions(self, idle_seconds: float) -> list[tuple[str, str]]:
        """(tenant, session_id) of live sessions with no heartbeat for `idle_seconds`."""
        return await self.sessions.silent(self.clock() - idle_seconds)

    async def finish(self, tenant: str, session_id: str, reason: str) -> None:
        """Finish the session; fenced while this controller leads (store/sessions.py), so
        the sweeper of a deposed leader gets StaleEpoch instead of finishing it."""
        if not await self.sessions.finish(tenant, session_id, reason, self.clock()):
            raise _no_session(session_id)

    async def expire_finished(self, retention_seconds: float, limit: int = 1000) -> int:
        """Forget up to `limit` sessions finished `retention_seconds` ago or longer (the
        leader's sweep); how many. Their samplers go with them (a session owns its
        sampling sessions); their runs and checkpoints stay."""
        expired = 0
        now = self.clock()
        for session_id in await self.sessions.finished_before(now - retention_seconds, limit):
            expired += await self.sessions.expire(session_id, now)
        return expired

    async def training_runs(self, session_id: str) -> list[str]:
        return await self.sessions.training_runs(session_id)

    async def get(self, tenant: str, session_id: str) -> Session:
        await self.check_session(tenant, session_id)
        return await self.sessions.load(tenant, session_id)

    async def list(self, tenant: str, limit: int, offset: int) -> tuple[list[str], int]:
        return await self.sessions.page(tenant, offset, limit if limit > 0 else 100)


def _no_session(session_id: str) -> errors.NotFound:
    return errors.NotFound(f"no session {session_id!r}", field="session_id")
