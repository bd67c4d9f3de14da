"""Checkpoint files from the controller's DownloadCheckpoint stream, passed on as they arrive:
one file's bytes, or a tar of them all.

The controller reads each file from disk in chunks and checks it against the checkpoint's
recorded SHA-256; each file's chunks are checked again here (offsets that run on from 0 to
the size its first chunk announces, bytes that hash to what its last chunk carries), and
the last chunk is passed on only after that, so a file that fails either check never
arrives whole: the stream raises, and the HTTP response is cut off rather than finished.
Memory holds a chunk or two, whatever the checkpoint's size. The tar is what the 0.24.1
CLI's `tinker checkpoint download` extracts: adapter_config.json, adapter_model.safetensors
and an empty `checkpoint_complete` marker; each member's header takes its size from the
first chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import tarfile
import time
from collections.abc import AsyncGenerator, AsyncIterator

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway.controller import ControllerClient

COMPLETE_MARKER = "checkpoint_complete"


async def chunks(
    controller: ControllerClient, tenant: str, tinker_path: str
) -> AsyncGenerator[common_pb2.FileChunk, None]:
    """The checkpoint's chunks, each file's checked (module docstring); closing it early
    cancels the controller's stream."""
    request = cpb.DownloadCheckpointRequest(tenant=tenant, tinker_path=tinker_path)
    name, size, done, digest = "", 0, 0, hashlib.sha256()
    async with contextlib.aclosing(controller.download_checkpoint(request)) as stream:
        async for chunk in stream:
            if chunk.path != name:
                if name:
                    raise _damaged(name, "ended without its SHA-256")
                name, size, done, digest = chunk.path, chunk.size_bytes, 0, hashlib.sha256()
            if chunk.offset != done:
                raise _damaged(name, f"skipped from byte {done} to {chunk.offset}")
            digest.update(chunk.data)
            done += len(chunk.data)
            if chunk.sha256:
                if done != size or digest.hexdigest() != chunk.sha256:
                    raise _damaged(name, "does not match its size and SHA-256")
                name = ""
            yield chunk
    if name:
        raise _damaged(name, "ended without its SHA-256")


async def names(controller: ControllerClient, tenant: str, tinker_path: str) -> list[str]:
    """The checkpoint's file names, without reading the files."""
    request = cpb.DownloadCheckpointRequest(tenant=tenant, tinker_path=tinker_path, names_only=True)
    return [chunk.path async for chunk in controller.download_checkpoint(request)]


def _damaged(name: str, what: str) -> errors.Internal:
    return errors.Internal(f"{name}: {what} in the checkpoint stream")


async def file_body(
    first: common_pb2.FileChunk, rest: AsyncGenerator[common_pb2.FileChunk, None]
) -> AsyncIterator[bytes]:
    """The bytes of the file `first` begins, then `rest` is closed (the controller's stream
    with it): the files after it are not read."""
    try:
        chunk = first
        while True:
            if chunk.data:
                yield chunk.data
            if chunk.sha256:
                return
            chunk = await anext(rest)
    finally:
        await rest.aclose()


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(time.time()), 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


async def tar_stream(
    first: common_pb2.FileChunk, rest: AsyncIterator[common_pb2.FileChunk]
) -> AsyncIterator[bytes]:
    """A tar of the files `first` and then `rest` hold, then the completion marker."""
    size = 0
    chunk: common_pb2.FileChunk | None = first
    while chunk is not None:
        if chunk.offset == 0:
            size = chunk.size_bytes
            yield _header(chunk.path, size)
        if chunk.data:
            yield chunk.data
        if chunk.sha256:
            yield b"\0" * (-size % tarfile.BLOCKSIZE)
        chunk = await anext(rest, None)
    yield _header(COMPLETE_MARKER, 0)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
