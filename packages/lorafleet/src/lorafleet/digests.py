"""The SHA-256 of a file on disk, read in blocks: the one way every service hashes a file.

Saved states (the trainer's manifest), published adapters (shared storage, the rollout's
check before serving) and the hub cache's content-addressed blobs all name files by this
digest, so they must agree on it byte for byte; `test_one_sha256_file.py` (beside the other
one-owner scans) fails on a second block-reading hasher anywhere in the source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_READ_BYTES = 1 << 20  # large enough to keep the hashing, not the reads, the cost


def sha256_file(path: Path) -> str:
    """Blocking: the hex SHA-256 of the file at `path`, in constant memory."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()
