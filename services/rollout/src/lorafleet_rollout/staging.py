"""Receiving an adapter's files as a stream of chunks into a private staging folder.

Chunks must arrive in order per file (offset == bytes received so far) under plain relative
paths; each file is hashed once, as its bytes arrive: a per-file SHA-256 on the last chunk is
checked when present, and `digests()` hands the same hashes to the whole-adapter check, so the
upload is never read back just to be hashed again. The folder is renamed
into place only after the whole adapter verifies (see `core.py`), so a broken upload never
leaves a half-written adapter behind.
"""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path, PurePosixPath

from lorafleet.errors import InvalidArgument


class AdapterUpload:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.folder = root / f".staging-{uuid.uuid4().hex}"
        self.folder.mkdir(parents=True)
        self.max_bytes = max_bytes
        self.total = 0
        self._sizes: dict[str, int] = {}
        self._hashes: dict[str, hashlib._Hash] = {}

    def write(self, path: str, offset: int, data: bytes, sha256: str) -> None:
        rel = PurePosixPath(path)
        if not path or rel.is_absolute() or ".." in rel.parts or path.startswith("."):
            raise InvalidArgument(f"{path!r} is not a plain relative file path", field="chunk.path")
        expected = self._sizes.get(path, 0)
        if offset != expected:
            raise InvalidArgument(
                f"{path}: chunk at offset {offset}, expected {expected}", field="chunk.offset"
            )
        self.total += len(data)
        if self.total > self.max_bytes:
            raise InvalidArgument(f"the adapter exceeds {self.max_bytes} bytes", field="chunk.data")
        target = self.folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("ab") as f:
            f.write(data)
        self._sizes[path] = expected + len(data)
        digest = self._hashes.setdefault(path, hashlib.sha256())
        digest.update(data)
        if sha256 and digest.hexdigest() != sha256.lower():
            raise InvalidArgument(
                f"{path}: SHA-256 {digest.hexdigest()} does not match the chunk's {sha256}",
                field="chunk.sha256",
            )

    def digests(self) -> dict[str, str]:
        """relative path -> SHA-256 of every file staged so far."""
        return {path: digest.hexdigest() for path, digest in self._hashes.items()}

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
