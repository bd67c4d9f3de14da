"""The checkpoint catalog's records in Redis: one hash per `tinker://` path, indexed by tenant,
by run and (when it expires) by expiry time.

Recording (`add_checkpoint`), removing (`catalog_remove`) and updating (`catalog_update`) a
checkpoint each touch the record and its indexes together, so each is one script: a
controller killed half-way never leaves an index naming a missing record or an expiring
record out of the expiry index. Removing also queues the checkpoint's folder in `reclaim`
(a `Reclaim` entry per path), which reclaim.py empties. Fencing: removing expired
checkpoints is the leader's sweep (`fenced=True` carries its epoch, refused once a newer
leader took over); recording, deleting and updating serve a request or a dispatch any
replica may make, and are not fenced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lorafleet import contract
from lorafleet.digests import FileDigest
from lorafleet.v1 import common_pb2
from lorafleet_controller.store import Store, blob, named, text

TRAINING, SAMPLER = 1, 2


@dataclass(frozen=True)
class CheckpointRecord:
    tinker_path: str
    tenant: str
    type: int
    training_run_id: str
    name: str
    created_at: float
    size_bytes: int
    public: bool
    expires_at: float
    user_metadata: dict[str, str]
    base_model: str
    lora: common_pb2.LoraConfig
    manifest: common_pb2.BlobRef
    has_optimizer: bool
    files_dir: str
    version: int
    # A sampler checkpoint's files (name -> SHA-256 and size), what a download checks them
    # against; a training checkpoint's are in its manifest.json.
    files: dict[str, FileDigest] = field(default_factory=dict)

    @property
    def checkpoint_id(self) -> str:
        return f"{'weights' if self.type == TRAINING else 'sampler_weights'}/{self.name}"


def holds(rec: CheckpointRecord) -> str:
    """The published version a sampler checkpoint names (`<rid>@<version>`), which stays
    while the checkpoint does (version_gc.py); '' for a training checkpoint."""
    if rec.type != SAMPLER or not rec.version:
        return ""
    return str(contract.AdapterId(rec.training_run_id, rec.version))


@dataclass(frozen=True)
class Reclaim:
    """A removed checkpoint's folder, waiting to be removed from disk (reclaim.py): whose it
    was, when it was removed, and, for a training checkpoint, its manifest (what a replay of
    a run that loaded it reads, and how the reclaimer knows the folder still holds it)."""

    tinker_path: str
    folder: str
    tenant: str
    type: int
    size_bytes: int
    removed_at: float
    manifest: common_pb2.BlobRef

    def encode(self) -> str:
        return json.dumps(
            {
                "folder": self.folder,
                "tenant": self.tenant,
                "type": self.type,
                "size": self.size_bytes,
                "at": self.removed_at,
                "manifest": {
                    "uri": self.manifest.uri,
                    "sha256": self.manifest.sha256,
                    "size": self.manifest.size_bytes,
                },
            },
            sort_keys=True,
        )

    @classmethod
    def decode(cls, tinker_path: str, raw: bytes | str) -> Reclaim:
        d = json.loads(raw)
        m = d["manifest"]
        return cls(
            tinker_path=tinker_path,
            folder=d["folder"],
            tenant=d["tenant"],
            type=int(d["type"]),
            size_bytes=int(d["size"]),
            removed_at=float(d["at"]),
            manifest=common_pb2.BlobRef(uri=m["uri"], sha256=m["sha256"], size_bytes=m["size"]),
        )


class CatalogRepo:
    """Every Redis access of the checkpoint catalog."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def add(self, rec: CheckpointRecord, operation_id: str) -> bool:
        """Record `rec` unless its path exists (False: the existing entry is kept as it is).
        `operation_id` names the save that made it."""
        own = [
            self.keys.ckpt(rec.tinker_path),
            self.keys.tenant_ckpts(rec.tenant),
            self.keys.run_ckpts(rec.training_run_id),
        ]
        out = named(
            await self.store.scripts.run(
                "add_checkpoint",
                own,
                rec.tinker_path,
                rec.tenant,
                rec.training_run_id,
                rec.created_at,
                rec.expires_at,
                holds(rec),
                "type",
                rec.type,
                "size",
                rec.size_bytes,
                "public",
                "1" if rec.public else "0",
                "metadata",
                json.dumps(rec.user_metadata, sort_keys=True),
                "base_model",
                rec.base_model,
                "lora",
                rec.lora.SerializeToString(deterministic=True),
                "manifest",
                rec.manifest.SerializeToString(),
                "has_optimizer",
                "1" if rec.has_optimizer else "0",
                "files_dir",
                rec.files_dir,
                "version",
                rec.version,
                "files",
                json.dumps(
                    {n: {"sha256": d.sha256, "size": d.size} for n, d in rec.files.items()},
                    sort_keys=True,
                ),
                "op",
                operation_id,
            )
        )
        return text(out["code"]) == "created"

    async def owner(self, tinker_path: str) -> str | None:
        """The operation that saved the checkpoint, or None when there is none."""
        op = await self.store.redis.hget(self.keys.ckpt(tinker_path), "op")
        return None if op is None else text(op)

    async def load(self, tinker_path: str) -> CheckpointRecord | None:
        raw = await self.store.redis.hgetall(self.keys.ckpt(tinker_path))
        if not raw or b"type" not in raw:
            return None
        return CheckpointRecord(
            tinker_path=tinker_path,
            tenant=text(raw[b"tenant"]),
            type=int(raw[b"type"]),
            training_run_id=text(raw[b"rid"]),
            name=contract.TinkerPath.parse(tinker_path, "tinker_path").name,
            created_at=float(raw[b"created_at"]),
            size_bytes=int(raw.get(b"size", b"0")),
            public=raw.get(b"public") == b"1",
            expires_at=float(raw.get(b"expires_at", b"0")),
            user_metadata=json.loads(raw.get(b"metadata", b"{}")),
            base_model=text(raw.get(b"base_model")),
            lora=common_pb2.LoraConfig.FromString(blob(raw.get(b"lora"))),
            manifest=common_pb2.BlobRef.FromString(blob(raw.get(b"manifest"))),
            has_optimizer=raw.get(b"has_optimizer") == b"1",
            files_dir=text(raw.get(b"files_dir")),
            version=int(raw.get(b"version", b"0")),
            files={
                n: FileDigest(d["sha256"], d["size"])
                for n, d in json.loads(raw.get(b"files", b"{}")).items()
            },
        )

    async def stored_bytes(self, tenant: str) -> int:
        """The sizes the tenant's checkpoint records hold, summed (one round trip each way)."""
        paths = await self.store.redis.zrange(self.keys.tenant_ckpts(tenant), 0, -1)
        if not paths:
            return 0
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for path in paths:
                pipe.hget(self.keys.ckpt(text(path)), "size")
            sizes = await pipe.execute()
        return sum(int(size or 0) for size in sizes)

    async def paths(self, tenant: str, training_run_id: str = "") -> list[str]:
        """The paths of a run's checkpoints (or, without a run, the tenant's), newest first."""
        key = (
            self.keys.run_ckpts(training_run_id)
            if training_run_id
            else self.keys.tenant_ckpts(tenant)
        )
        return [text(p) for p in await self.store.redis.zrevrange(key, 0, -1)]

    async def remove(
        self, rec: CheckpointRecord, reclaim: Reclaim | None, now: float, *, fenced: bool = False
    ) -> None:
        """Drop the record and its index entries and queue `reclaim` (`fenced`: the leader's
        expiry sweep); a sampler checkpoint lets its published version go (version_gc.py)."""
        own = [
            self.keys.ckpt(rec.tinker_path),
            self.keys.tenant_ckpts(rec.tenant),
            self.keys.run_ckpts(rec.training_run_id),
        ]
        await self.store.scripts.run(
            "catalog_remove",
            own,
            rec.tinker_path,
            rec.tenant,
            rec.training_run_id,
            reclaim.encode() if reclaim else "",
            holds(rec),
            now,
            epoch=self.store.leader_epoch() if fenced else None,
        )

    async def reclaiming(self) -> list[Reclaim]:
        """Every folder waiting to be reclaimed."""
        raw = await self.store.redis.hgetall(self.keys.reclaim)
        return [Reclaim.decode(text(path), value) for path, value in raw.items()]

    async def reclaim_entry(self, tinker_path: str) -> Reclaim | None:
        raw = await self.store.redis.hget(self.keys.reclaim, tinker_path)
        return None if raw is None else Reclaim.decode(tinker_path, raw)

    async def reclaimed(self, entry: Reclaim) -> None:
        """Forget `entry` once its folder is gone (kept when the path was removed again)."""
        await self.store.scripts.run("reclaimed", [], entry.tinker_path, entry.encode())

    async def update(self, tinker_path: str, public: bool | None, expires_at: float | None) -> None:
        """Set `public` (None: unchanged) and the expiry: None unchanged, 0 never expires.
        A record removed meanwhile is not brought back."""
        await self.store.scripts.run(
            "catalog_update",
            [self.keys.ckpt(tinker_path)],
            tinker_path,
            "" if public is None else "1" if public else "0",
            "" if expires_at is None else expires_at,
        )

    async def expired(self, now: float) -> list[str]:
        """Paths whose expiry time has passed."""
        return [
            text(p) for p in await self.store.redis.zrangebyscore(self.keys.ckpt_ttl, "-inf", now)
        ]

    async def drop_expiry(self, tinker_path: str) -> None:
        """Forget the expiry of a path whose record is already gone (the leader's sweep)."""
        await self.store.redis.zrem(self.keys.ckpt_ttl, tinker_path)
