"""The API keys' records in Redis: every read and write of the key family (tenancy.py).

A key is a hash (`api_key`, by key id) holding its tenant, label, creation time, revoked
flag and the SHA-256 of its plaintext; `key_hash` maps that digest back to the key id (how a
presented key is found), and `tenant_keys` lists a tenant's key ids. Creating a key writes
all three in one script (`key_create`), so a key found by its digest always has its record;
revoking is a check-then-write of one hash, also one script (`key_revoke`).

Fencing: none. Keys are created and revoked by requests that any controller replica serves
(the gateway's admin calls), never by the leader's loops, so no write here carries an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet_controller.store import Store, named, text


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    label: str
    created_at: float
    revoked: bool


@dataclass(frozen=True)
class KeyDigest:
    """What authentication compares: the stored digest of a key found by its digest."""

    key_id: str
    tenant: str
    digest: str
    revoked: bool


class ApiKeysRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def create(
        self, key_id: str, tenant: str, label: str, created_at: float, digest: str
    ) -> None:
        await self.store.scripts.run(
            "key_create",
            [self.keys.api_key(key_id), self.keys.key_hash(digest), self.keys.tenant_keys(tenant)],
            key_id,
            tenant,
            label,
            created_at,
            digest,
        )

    async def by_digest(self, digest: str) -> KeyDigest | None:
        """The key whose plaintext hashes to `digest`; None when there is none (or its record
        lost its stored digest)."""
        key_id = await self.store.redis.get(self.keys.key_hash(digest))
        if key_id is None:
            return None
        tenant, revoked, stored = await self.store.redis.hmget(
            self.keys.api_key(text(key_id)), "tenant", "revoked", "hash"
        )
        if stored is None:
            return None
        return KeyDigest(text(key_id), text(tenant), text(stored), revoked == b"1")

    async def of_tenant(self, tenant: str) -> list[ApiKey]:
        """The tenant's keys, revoked ones included, by key id."""
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

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked; False when there is no such key."""
        out = named(await self.store.scripts.run("key_revoke", [self.keys.api_key(key_id)], key_id))
        return text(out["code"]) == "revoked"
