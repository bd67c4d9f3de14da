"""Checkpoint files from the controller's DownloadCheckpoint stream, whole or as a tar.

Each file arrives as consecutive FileChunks (the last one carries the file's SHA-256, which
is checked). Files are yielded one at a time, so memory holds one adapter file, not the whole
checkpoint. The tar is what the 0.24.1 CLI's `tinker checkpoint download` extracts:
adapter_config.json, adapter_model.safetensors and an empty `checkpoint_complete` marker.
"""

from __future__ import annotations

import hashlib
import tarfile
import time
from collections.abc import AsyncIterator

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway.controller import ControllerClient

COMPLETE_MARKER = "checkpoint_complete"


async def files(
    controller: ControllerClient, tenant: str, tinker_path: str
) -> AsyncIterator[tuple[str, bytes]]:
    """(relative path, content) per file of the checkpoint."""
    name, digest = "", ""
    parts: list[bytes] = []
    request = cpb.DownloadCheckpointRequest(tenant=tenant, tinker_path=tinker_path)
    async for chunk in controller.download_checkpoint(request):
        if chunk.path != name and parts:
            yield _checked(name, parts, digest)
            parts, digest = [], ""
        name = chunk.path
        parts.append(chunk.data)
        digest = chunk.sha256 or digest
    if name:
        yield _checked(name, parts, digest)


def _checked(name: str, parts: list[bytes], digest: str) -> tuple[str, bytes]:
    data = b"".join(parts)
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise errors.Internal(f"{name}: checksum mismatch in the checkpoint stream")
    return name, data


def _member(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    pad = (-len(data)) % tarfile.BLOCKSIZE
    return info.tobuf(format=tarfile.PAX_FORMAT) + data + b"\0" * pad


async def tar_stream(
    first: tuple[str, bytes], rest: AsyncIterator[tuple[str, bytes]]
) -> AsyncIterator[bytes]:
    """A tar of `first`, then `rest`, then the completion marker."""
    yield _member(*first)
    async for name, data in rest:
        yield _member(name, data)
    yield _member(COMPLETE_MARKER, b"")
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
