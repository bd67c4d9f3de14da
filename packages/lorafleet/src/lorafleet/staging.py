"""Files received as a stream of chunks, staged in a private folder.

The trainer's ImportAdapter and the rollout's LoadAdapter (and its reads from shared storage)
take files from the network under names the sender chose, so one set of walls stands between
those names and the disk, written once here:

- a path is canonical, relative and plain (no `..`, no part starting with `.`, no NUL): two
  spellings of one file (`a//b`, `a/./b`) cannot append to each other behind their digests;
- chunks of a file arrive in order (offset == bytes received so far) and none after the file's
  final SHA-256 was checked;
- the whole stream is capped at `max_bytes`, checked before a byte is written;
- each file is hashed once, as its bytes arrive: a SHA-256 on a chunk (the sender puts it on
  the last one) is checked at once, and `digests()` hands the same hashes to a whole-upload
  check, so an upload is never read back just to be hashed again.

The folder is private (`.staging-<random>` under the root given); the caller moves it into
place once everything verifies, or calls `discard()`, so a broken upload never leaves a
half-written folder behind. Torch- and gRPC-free: trainer and rollout share it.
"""

from __future__ import annotations

import hashlib
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from lorafleet.errors import InvalidArgument

#: Default cap on one received adapter, all files together (each service's setting).
MAX_ADAPTER_BYTES = 1 << 30
_SHOWN = 80  # characters of a refused path echoed back


def _plain(path: str) -> PurePosixPath:
    rel = PurePosixPath(path)
    if (
        not path
        or "\x00" in path
        or rel.is_absolute()
        or rel.as_posix() != path
        or any(part.startswith(".") for part in rel.parts)
    ):
        shown = path if len(path) <= _SHOWN else path[:_SHOWN] + "..."
        raise InvalidArgument(f"{shown!r} is not a plain relative file path", field="chunk.path")
    return rel


class ChunkedUpload:
    """One stream of file chunks into a private folder under `root`.

    `names`, when given, is the only files the stream may carry (others: InvalidArgument
    naming chunk.path). Every refusal names the chunk field at fault.
    """

    def __init__(self, root: Path, max_bytes: int, names: Collection[str] | None = None) -> None:
        self.max_bytes = max_bytes
        self.names = names
        self.total = 0
        self._sizes: dict[str, int] = {}
        self._hashes: dict[str, hashlib._Hash] = {}
        self._verified: set[str] = set()
        self.folder = root / f".staging-{uuid.uuid4().hex}"
        self.folder.mkdir(parents=True)

    def write(self, path: str, offset: int, data: bytes, sha256: str) -> None:
        """Append one chunk; `sha256` (hex, may be empty) is the whole file's, checked when
        given, which closes the file to further chunks."""
        rel = _plain(path)
        if self.names is not None and path not in self.names:
            raise InvalidArgument(
                f"{path!r} is not one of {', '.join(sorted(self.names))}", field="chunk.path"
            )
        expected = self._sizes.get(path, 0)
        if path in self._verified or offset != expected:
            after = " (the file was already complete)" if path in self._verified else ""
            raise InvalidArgument(
                f"{path}: chunk at offset {offset}, expected {expected}{after}",
                field="chunk.offset",
            )
        if self.total + len(data) > self.max_bytes:
            raise InvalidArgument(
                f"the upload exceeds {self.max_bytes} bytes (at {path}, offset {offset})",
                field="chunk.data",
                reason="TOO_LARGE",
            )
        target = self.folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("ab") as f:
            f.write(data)
        self.total += len(data)
        self._sizes[path] = expected + len(data)
        digest = self._hashes.setdefault(path, hashlib.sha256())
        digest.update(data)
        if sha256:
            if digest.hexdigest() != sha256.lower():
                raise InvalidArgument(
                    f"{path}: SHA-256 {digest.hexdigest()} does not match the chunk's {sha256}",
                    field="chunk.sha256",
                )
            self._verified.add(path)

    def digests(self) -> dict[str, str]:
        """relative path -> SHA-256 of every file staged so far."""
        return {path: digest.hexdigest() for path, digest in self._hashes.items()}

    def require_complete(self, names: Collection[str]) -> None:
        """Each of `names` arrived and its last chunk carried a matching SHA-256."""
        for name in names:
            if name not in self._verified:
                raise InvalidArgument(
                    f"{name} is missing or its last chunk carried no SHA-256", field="chunk.sha256"
                )

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
