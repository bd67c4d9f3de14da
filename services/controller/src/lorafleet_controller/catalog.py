"""The checkpoint catalog: `tinker://` paths → saved states and sampler exports, in Redis.

Training checkpoints (`weights/<name>`) point at a trainer's saved state by its manifest
(file:// URI + SHA-256); sampler checkpoints (`sampler_weights/<name>`) are PEFT folders
the controller received while publishing and keeps under its own storage root. Lookups are
tenant-checked (another tenant's path is NotFound) unless the checkpoint is public.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.clients import file_chunks
from lorafleet_controller.store import Store, blob, named, text
from lorafleet_controller.validate import parse_tinker_path

TRAINING, SAMPLER = 1, 2
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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

    @property
    def checkpoint_id(self) -> str:
        return f"{'weights' if self.type == TRAINING else 'sampler_weights'}/{self.name}"


class Catalog:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.keys = store.keys
        self.clock = clock

    async def add(
        self,
        *,
        tinker_path: str,
        tenant: str,
        type: int,
        base_model: str,
        lora: common_pb2.LoraConfig,
        manifest: common_pb2.BlobRef | None = None,
        has_optimizer: bool = False,
        files_dir: str = "",
        version: int = 0,
        ttl_seconds: float = 0,
        user_metadata: dict[str, str] | None = None,
        size_bytes: int = 0,
        operation_id: str = "",
    ) -> bool:
        """Record a checkpoint in one script. Idempotent: an existing entry is kept as it is
        (False). `operation_id` names the save that made it, so a re-dispatch recognises it."""
        rid, _, _ = parse_tinker_path(tinker_path, "path")
        now = self.clock()
        expires = now + ttl_seconds if ttl_seconds > 0 else 0
        own = [
            self.keys.ckpt(tinker_path),
            self.keys.tenant_ckpts(tenant),
            self.keys.run_ckpts(rid),
        ]
        out = named(
            await self.store.scripts.run(
                "add_checkpoint",
                own,
                tinker_path,
                tenant,
                rid,
                now,
                expires,
                "type",
                type,
                "size",
                size_bytes or (manifest.size_bytes if manifest else 0),
                "public",
                "0",
                "metadata",
                json.dumps(user_metadata or {}, sort_keys=True),
                "base_model",
                base_model,
                "lora",
                lora.SerializeToString(deterministic=True),
                "manifest",
                manifest.SerializeToString() if manifest else b"",
                "has_optimizer",
                "1" if has_optimizer else "0",
                "files_dir",
                files_dir,
                "version",
                version,
                "op",
                operation_id,
            )
        )
        return text(out["code"]) == "created"

    async def owner(self, tinker_path: str) -> str | None:
        """The operation that saved the checkpoint, or None when there is none."""
        op = await self.store.redis.hget(self.keys.ckpt(tinker_path), "op")
        return None if op is None else text(op)

    async def get(
        self, tenant: str, tinker_path: str, *, allow_public: bool = True
    ) -> CheckpointRecord:
        parse_tinker_path(tinker_path, "tinker_path")
        rec = await self._load(tinker_path)
        if rec is None or (rec.tenant != tenant and not (allow_public and rec.public)):
            raise errors.NotFound(f"no checkpoint {tinker_path!r}", field="tinker_path")
        if rec.expires_at and rec.expires_at < self.clock():
            raise errors.NotFound(f"checkpoint {tinker_path!r} expired", field="tinker_path")
        return rec

    async def _load(self, tinker_path: str) -> CheckpointRecord | None:
        raw = await self.store.redis.hgetall(self.keys.ckpt(tinker_path))
        if not raw or b"type" not in raw:
            return None
        _, _, name = parse_tinker_path(tinker_path, "tinker_path")
        return CheckpointRecord(
            tinker_path=tinker_path,
            tenant=text(raw[b"tenant"]),
            type=int(raw[b"type"]),
            training_run_id=text(raw[b"rid"]),
            name=name,
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
        )

    async def manifest_for(self, tinker_path: str) -> common_pb2.BlobRef | None:
        rec = await self._load(tinker_path)
        return rec.manifest if rec is not None and rec.type == TRAINING else None

    async def list(
        self, tenant: str, training_run_id: str, limit: int, offset: int
    ) -> tuple[list[CheckpointRecord], int]:
        key = (
            self.keys.run_ckpts(training_run_id)
            if training_run_id
            else self.keys.tenant_ckpts(tenant)
        )
        paths = [text(p) for p in await self.store.redis.zrevrange(key, 0, -1)]
        recs = []
        for path in paths:
            rec = await self._load(path)
            if rec is not None and rec.tenant == tenant:
                recs.append(rec)
        stop = offset + limit if limit > 0 else None
        return recs[offset:stop], len(recs)

    async def delete(self, tenant: str, tinker_path: str) -> None:
        rec = await self.get(tenant, tinker_path, allow_public=False)
        await self._remove(rec)

    async def _remove(self, rec: CheckpointRecord) -> None:
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.ckpt(rec.tinker_path))
            pipe.zrem(self.keys.tenant_ckpts(rec.tenant), rec.tinker_path)
            pipe.zrem(self.keys.run_ckpts(rec.training_run_id), rec.tinker_path)
            pipe.zrem(self.keys.ckpt_ttl, rec.tinker_path)
            await pipe.execute()
        if rec.files_dir:
            await asyncio.to_thread(shutil.rmtree, rec.files_dir, ignore_errors=True)

    async def update(
        self,
        tenant: str,
        tinker_path: str,
        public: bool | None,
        ttl_seconds: int | None,
        clear_ttl: bool,
    ) -> CheckpointRecord:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise errors.InvalidArgument(
                "must be > 0 (use clear_ttl to remove)", field="ttl_seconds"
            )
        rec = await self.get(tenant, tinker_path, allow_public=False)
        key = self.keys.ckpt(tinker_path)
        async with self.store.redis.pipeline(transaction=True) as pipe:
            if public is not None:
                pipe.hset(key, "public", "1" if public else "0")
            if clear_ttl:
                pipe.hset(key, "expires_at", 0)
                pipe.zrem(self.keys.ckpt_ttl, tinker_path)
            elif ttl_seconds is not None:
                expires = self.clock() + ttl_seconds
                pipe.hset(key, "expires_at", expires)
                pipe.zadd(self.keys.ckpt_ttl, {tinker_path: expires})
            await pipe.execute()
        return await self.get(rec.tenant, tinker_path)

    async def sweep_expired(self) -> int:
        paths = await self.store.redis.zrangebyscore(self.keys.ckpt_ttl, "-inf", self.clock())
        for path in paths:
            rec = await self._load(text(path))
            if rec is not None:
                await self._remove(rec)
            else:
                await self.store.redis.zrem(self.keys.ckpt_ttl, text(path))
        return len(paths)

    async def read_files(self, rec: CheckpointRecord) -> dict[str, bytes]:
        """The checkpoint's PEFT adapter files (sampler folder, or the trainer's state), read
        in a worker thread so the event loop keeps serving."""
        return await asyncio.to_thread(_read_adapter_files, rec)

    async def chunks(self, rec: CheckpointRecord) -> builtins.list[common_pb2.FileChunk]:
        return file_chunks(await self.read_files(rec))


def _read_adapter_files(rec: CheckpointRecord) -> dict[str, bytes]:
    """Blocking: run in a worker thread (Catalog.read_files)."""
    if rec.files_dir:
        folder = Path(rec.files_dir)
    else:
        parsed = urlparse(rec.manifest.uri)
        if parsed.scheme != "file":
            raise errors.FailedPrecondition(
                "the checkpoint's files are not readable by the controller",
                field="tinker_path",
            )
        folder = Path(unquote(parsed.path))
    files = {}
    for name in ADAPTER_FILES:
        if not (folder / name).is_file():
            raise errors.NotFound(f"checkpoint files are missing ({name})", field="tinker_path")
        files[name] = (folder / name).read_bytes()
    return files
