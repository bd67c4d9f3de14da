"""manifest.json: what a saved state's folder holds, file by file (SHA-256 and size).

The trainer writes it last into every saved state, and the state's reference (the catalog's
BlobRef) is this file's SHA-256; the trainer checks it on every load, the controller on
every download and every sampler made from the state. Both read the one format defined
here, so what one writes the other can check.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.digests import FileDigest

MANIFEST = "manifest.json"
STATE_FORMAT = "lorafleet-trainer-state-v1"


@dataclass(frozen=True)
class Manifest:
    format: str
    files: dict[str, FileDigest]


def render(files: Mapping[str, FileDigest]) -> dict[str, Any]:
    """The manifest of a state folder holding `files`, as the JSON object to write."""
    listed = {n: {"sha256": d.sha256, "size": d.size} for n, d in sorted(files.items())}
    return {"format": STATE_FORMAT, "files": listed}


def parse(raw: bytes) -> Manifest:
    """The manifest in `raw`; ValueError, saying what is wrong, when it is not one. The
    format is returned, not checked: a reader refuses an unknown one in its own words."""
    try:
        obj = json.loads(raw)
        files = {
            str(name): FileDigest(str(meta["sha256"]), int(meta["size"]))
            for name, meta in obj["files"].items()
        }
        return Manifest(str(obj.get("format", "")), files)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{MANIFEST} is unreadable: {exc!r}") from None
