"""The SHA-256 of a file on disk, read in blocks: the one way every service hashes a file.

Saved states (the trainer's manifest), published adapters (shared storage, the rollout's
check before serving) and the hub cache's content-addressed blobs all name files by this
digest, so they must agree on it byte for byte; `test_one_sha256_file.py` (beside the other
one-owner scans) fails on a second block-reading hasher anywhere in the source.

`verified_blocks` is the streaming form: a file's bytes handed on block by block (a 1.6 GB
adapter never sits in memory) while they are hashed, refused at the end when they are not
the bytes its manifest names.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import FailedPrecondition, NotFound

_READ_BYTES = 1 << 20  # large enough to keep the hashing, not the reads, the cost
BLOCK_BYTES = _READ_BYTES  # what verified_blocks hands on per block (one gRPC chunk)


@dataclass(frozen=True)
class FileDigest:
    """What a manifest records of one file."""

    sha256: str
    size: int


def sha256_file(path: Path) -> str:
    """Blocking: the hex SHA-256 of the file at `path`, in constant memory."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def open_plain_file(path: Path, field: str) -> int:
    """Blocking: a read-only descriptor of the regular file at `path`. A symbolic link is
    refused by the open itself (O_NOFOLLOW), so one swapped in after a caller's checks is
    refused too; so is anything but a regular file (a FIFO would block the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFound(f"{path.name} is missing", field=field) from None
    except OSError:  # ELOOP: the last component is a symbolic link
        if path.is_symlink():
            raise FailedPrecondition(
                f"{path.name} is a symbolic link; refused", field=field, reason="UNSAFE_PATH"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FailedPrecondition(
            f"{path.name} is not a regular file; refused", field=field, reason="UNSAFE_PATH"
        )
    return fd


def _open_expected(path: Path, expected: FileDigest, field: str) -> int:
    fd = open_plain_file(path, field)
    size = os.fstat(fd).st_size
    if size != expected.size:
        os.close(fd)
        raise FailedPrecondition(
            f"{path.name} holds {size} bytes, its manifest {expected.size}",
            field=field,
            reason="DIGEST_MISMATCH",
        )
    return fd


def check_plain_file(path: Path, expected: FileDigest, field: str) -> None:
    """Blocking, and cheap (no read): what verified_blocks refuses before its first block, so
    a caller can refuse it before it changes anything."""
    os.close(_open_expected(path, expected, field))


def verified_blocks(path: Path, expected: FileDigest, field: str) -> Iterator[bytes]:
    """Blocking generator: the file's bytes in blocks of at most BLOCK_BYTES, hashed as they
    are read. A link, a special file or a size other than `expected`'s is refused before the
    first block (check_plain_file); bytes that do not hash to `expected.sha256` raise after
    the last block, before the generator finishes, so a caller that holds back the last
    block until then never passes on the whole of a damaged file. Refusals are
    FailedPrecondition, reason UNSAFE_PATH or DIGEST_MISMATCH."""
    with os.fdopen(_open_expected(path, expected, field), "rb", buffering=0) as f:
        digest = hashlib.sha256()
        read = 0
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            digest.update(block)
            read += len(block)
            yield block
        if read != expected.size or digest.hexdigest() != expected.sha256:
            raise FailedPrecondition(
                f"{path.name} does not match the SHA-256 its manifest records",
                field=field,
                reason="DIGEST_MISMATCH",
            )
