"""The checkpoint catalog: `tinker://` paths → saved states and sampler exports, in Redis.

Training checkpoints (`weights/<name>`) point at a trainer's saved state by its manifest
(file:// URI + SHA-256); sampler checkpoints (`sampler_weights/<name>`) are PEFT folders
the controller received while publishing and keeps under its own storage root. Lookups are
tenant-checked (another tenant's path is NotFound) unless the checkpoint is public.

A checkpoint's files leave only as the bytes its record names (a training checkpoint's
manifest.json, a sampler checkpoint's recorded digests): downloads and samplers made from a
checkpoint read them in blocks, checked on the way (lorafleet.digests.verified_blocks), never
through a symbolic link or from a folder that is a link elsewhere, so neither a 1.6 GB adapter
nor a file swapped on disk passes through memory whole or unnoticed.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lorafleet import errors, manifests
from lorafleet.digests import FileDigest, check_plain_file, open_plain_file, verified_blocks
from lorafleet.manifests import MANIFEST
from lorafleet.v1 import common_pb2
from lorafleet_controller.store import Store
from lorafleet_controller.store.catalog import (
    SAMPLER,
    TRAINING,
    CatalogRepo,
    CheckpointRecord,
    Reclaim,
)
from lorafleet_controller.validate import parse_tinker_path

__all__ = ["SAMPLER", "TRAINING", "Catalog", "CheckpointRecord", "StoredFile", "copy_files"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FIELD = "tinker_path"  # what a refused checkpoint's errors name


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
        files: dict[str, FileDigest] | None = None,
    ) -> bool:
        """Record a checkpoint in one script. Idempotent: an existing entry is kept as it is
        (False). `operation_id` names the save that made it, so a re-dispatch recognises it.
        `files`: a sampler checkpoint's digests (a training checkpoint's are its manifest)."""
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
            files=files or {},
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
        """A training checkpoint's manifest, for a replay's load_state: a removed one's while
        its folder waits to be reclaimed (a replay holds it there)."""
        rec = await self.repo.load(tinker_path)
        if rec is not None:
            return rec.manifest if rec.type == TRAINING else None
        entry = await self.repo.reclaim_entry(tinker_path)
        return entry.manifest if entry is not None and entry.type == TRAINING else None

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
        """The record goes now; a training checkpoint's folder, when the controller can reach
        it, goes to the reclaim queue in the same step (reclaim.py removes it from disk). A
        sampler checkpoint's folder is its published version's, which rollouts load the
        version from and samplers made from it use: it goes with the version, once nothing
        else holds that (version_gc.py)."""
        now = self.clock()
        folder = _folder(rec) if rec.type == TRAINING else None
        reclaim = (
            Reclaim(
                tinker_path=rec.tinker_path,
                folder=str(folder),
                tenant=rec.tenant,
                type=rec.type,
                size_bytes=rec.size_bytes,
                removed_at=now,
                manifest=rec.manifest,
            )
            if folder is not None
            else None
        )
        await self.repo.remove(rec, reclaim, now, fenced=fenced)

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

    async def files(self, rec: CheckpointRecord) -> builtins.list[StoredFile]:
        """The checkpoint's PEFT adapter files and what each must hash to, checked as far as
        can be without reading them (stored_files), in a worker thread."""
        return await asyncio.to_thread(stored_files, rec)

    async def chunks(
        self, rec: CheckpointRecord, *, names_only: bool = False
    ) -> AsyncIterator[common_pb2.FileChunk]:
        """The checkpoint's files as FileChunks streamed from disk (DownloadCheckpoint): the
        first chunk of a file carries its size, the last its SHA-256, and the last is sent
        only once the file's bytes matched it; a mismatch raises instead. `names_only`: one
        chunk per file, no data."""
        for stored in await self.files(rec):
            if names_only:
                yield common_pb2.FileChunk(
                    path=stored.name, size_bytes=stored.digest.size, sha256=stored.digest.sha256
                )
                continue
            async for chunk in _streamed(stored):
                yield chunk


@dataclass(frozen=True)
class StoredFile:
    """One adapter file of a checkpoint: where it lies and what its bytes must hash to."""

    name: str
    path: Path
    digest: FileDigest


def stored_files(rec: CheckpointRecord) -> list[StoredFile]:
    """Blocking: the checkpoint's adapter files, refused unless they lie in the checkpoint's
    own folder as plain files of the recorded sizes (the folder itself no symbolic link: its
    files would lie elsewhere) and a digest is recorded for each: a training checkpoint's
    in its manifest.json, itself matching the SHA-256 the catalog holds."""
    folder = _folder(rec)
    if folder is None:
        raise errors.FailedPrecondition(
            "the checkpoint's files are not readable by the controller", field=FIELD
        )
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        raise errors.NotFound("the checkpoint's folder is missing", field=FIELD) from None
    if stat.S_ISLNK(mode):
        raise errors.FailedPrecondition(
            f"the checkpoint's folder {folder} is a symbolic link (its files lie outside "
            "it); refused",
            field=FIELD,
            reason="UNSAFE_PATH",
        )
    digests = rec.files if rec.type == SAMPLER else _manifest(folder, rec.manifest.sha256)
    out = []
    for name in ADAPTER_FILES:
        if name not in digests:
            raise errors.FailedPrecondition(
                f"the checkpoint records no SHA-256 of {name}", field=FIELD, reason="NO_DIGEST"
            )
        stored = StoredFile(name, folder / name, digests[name])
        check_plain_file(stored.path, stored.digest, FIELD)
        out.append(stored)
    return out


def _folder(rec: CheckpointRecord) -> Path | None:
    """The checkpoint's folder: a sampler checkpoint's, or the one holding a training
    checkpoint's manifest when it is a file:// URI (None otherwise)."""
    if rec.files_dir:
        return Path(rec.files_dir)
    parsed = urlparse(rec.manifest.uri)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" and parsed.path else None


def _manifest(folder: Path, sha256: str) -> dict[str, FileDigest]:
    """Blocking: the files a training checkpoint's manifest.json lists, once its bytes match
    the SHA-256 the catalog recorded for it."""
    with os.fdopen(open_plain_file(folder / MANIFEST, FIELD), "rb") as f:
        raw = f.read()
    if not sha256 or hashlib.sha256(raw).hexdigest() != sha256:
        raise errors.FailedPrecondition(
            f"{MANIFEST} does not match the SHA-256 the catalog records",
            field=FIELD,
            reason="DIGEST_MISMATCH",
        )
    try:
        return manifests.parse(raw).files
    except ValueError as exc:
        raise errors.FailedPrecondition(str(exc), field=FIELD, reason="DIGEST_MISMATCH") from None


def copy_files(files: list[StoredFile], dest: Path) -> None:
    """Blocking: each file streamed into the folder `dest` and checked on the way; a refused
    file raises with `dest` half written (the caller drops it)."""
    for stored in files:
        with (dest / stored.name).open("wb") as out:
            for block in verified_blocks(stored.path, stored.digest, FIELD):
                out.write(block)


async def _streamed(stored: StoredFile) -> AsyncIterator[common_pb2.FileChunk]:
    """One file's chunks, read in a worker thread block by block; each block is held until
    the next one is read, so the last goes out only after verified_blocks checked the
    whole file (memory: two blocks, whatever the file's size)."""
    blocks = verified_blocks(stored.path, stored.digest, FIELD)
    offset, held = 0, None
    while (block := await asyncio.to_thread(next, blocks, None)) is not None:
        if held is not None:
            yield _chunk(stored, offset, held)
            offset += len(held)
        held = block
    yield _chunk(stored, offset, held or b"", sha256=stored.digest.sha256)


def _chunk(stored: StoredFile, offset: int, data: bytes, sha256: str = "") -> common_pb2.FileChunk:
    size = stored.digest.size if offset == 0 else 0
    return common_pb2.FileChunk(
        path=stored.name, offset=offset, data=data, sha256=sha256, size_bytes=size
    )
