"""The checkpoint catalog: `tinker://` paths → saved states and sampler exports, in Redis.

Training checkpoints (`weights/<name>`) point at a trainer's saved state by its manifest
(file:// URI + SHA-256); sampler checkpoints (`sampler_weights/<name>`) are PEFT folders
the controller received while publishing and keeps under its own storage root. Lookups are
tenant-checked (another tenant's path is NotFound) unless the checkpoint is public.
"""

from __future__ import annotations

import asyncio
import builtins
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.clients import file_chunks
from lorafleet_controller.store import Store
from lorafleet_controller.store.catalog import SAMPLER, TRAINING, CatalogRepo, CheckpointRecord
from lorafleet_controller.validate import parse_tinker_path

__all__ = ["SAMPLER", "TRAINING", "Catalog", "CheckpointRecord"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class Catalog:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.repo = CatalogRepo(store)
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
        rid, _, name = parse_tinker_path(tinker_path, "path")
        now = self.clock()
        rec = CheckpointRecord(
            tinker_path=tinker_path,
            tenant=tenant,
            type=type,
            training_run_id=rid,
            name=name,
            created_at=now,
            size_bytes=size_bytes or (manifest.size_bytes if manifest else 0),
            public=False,
            expires_at=now + ttl_seconds if ttl_seconds > 0 else 0,
            user_metadata=user_metadata or {},
            base_model=base_model,
            lora=lora,
            manifest=manifest or common_pb2.BlobRef(),
            has_optimizer=has_optimizer,
            files_dir=files_dir,
            version=version,
        )
        return await self.repo.add(rec, operation_id)

    async def owner(self, tinker_path: str) -> str | None:
        """The operation that saved the checkpoint, or None when there is none."""
        return await self.repo.owner(tinker_path)

    async def get(
        self, tenant: str, tinker_path: str, *, allow_public: bool = True
    ) -> CheckpointRecord:
        parse_tinker_path(tinker_path, "tinker_path")
        rec = await self.repo.load(tinker_path)
        if rec is None or (rec.tenant != tenant and not (allow_public and rec.public)):
            raise errors.NotFound(f"no checkpoint {tinker_path!r}", field="tinker_path")
        if rec.expires_at and rec.expires_at < self.clock():
            raise errors.NotFound(f"checkpoint {tinker_path!r} expired", field="tinker_path")
        return rec

    async def manifest_for(self, tinker_path: str) -> common_pb2.BlobRef | None:
        rec = await self.repo.load(tinker_path)
        return rec.manifest if rec is not None and rec.type == TRAINING else None

    async def list(
        self, tenant: str, training_run_id: str, limit: int, offset: int
    ) -> tuple[list[CheckpointRecord], int]:
        paths = await self.repo.paths(tenant, training_run_id)
        recs = []
        for path in paths:
            rec = await self.repo.load(path)
            if rec is not None and rec.tenant == tenant:
                recs.append(rec)
        stop = offset + limit if limit > 0 else None
        return recs[offset:stop], len(recs)

    async def delete(self, tenant: str, tinker_path: str) -> None:
        rec = await self.get(tenant, tinker_path, allow_public=False)
        await self._remove(rec)

    async def _remove(self, rec: CheckpointRecord, *, fenced: bool = False) -> None:
        await self.repo.remove(rec, fenced=fenced)
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
        expires = 0.0 if clear_ttl else None
        if ttl_seconds is not None and not clear_ttl:
            expires = self.clock() + ttl_seconds
        await self.repo.update(tinker_path, public, expires)
        return await self.get(rec.tenant, tinker_path)

    async def sweep_expired(self) -> int:
        """Remove the checkpoints whose time is up (the leader's sweep: fenced)."""
        paths = await self.repo.expired(self.clock())
        for path in paths:
            rec = await self.repo.load(path)
            if rec is not None:
                await self._remove(rec, fenced=True)
            else:
                await self.repo.drop_expiry(path)
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
