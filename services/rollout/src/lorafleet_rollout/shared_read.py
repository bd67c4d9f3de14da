"""Staging an adapter published by reference: the replica reads the files from shared storage.

The header names each file (URI inside this replica's shared adapter root, SHA-256, size);
the files are read in blocks into the same private staging folder a streamed upload uses,
through the same checks (plain relative names, size cap, SHA-256 per file), so what serves is
byte for byte what the trainer wrote: an edited or torn file is refused and nothing is
installed. Blocking: run in a worker thread.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.errors import InvalidArgument
from lorafleet.shared_storage import FileRef, resolve
from lorafleet.staging import ChunkedUpload

_BLOCK = 1 << 20


def stage_refs(upload: ChunkedUpload, root: Path, refs: dict[str, FileRef]) -> None:
    for name, ref in sorted(refs.items()):
        field = f"header.file_refs[{name}]"
        if not ref.sha256:
            raise InvalidArgument("every file needs its SHA-256", field=f"{field}.sha256")
        path = resolve(root, ref.uri, f"{field}.uri")
        if not path.is_file():
            raise InvalidArgument(f"{ref.uri} is not a readable file", field=f"{field}.uri")
        size = path.stat().st_size
        if size != ref.size_bytes:
            raise InvalidArgument(
                f"{ref.uri} holds {size} bytes, the reference says {ref.size_bytes}",
                field=f"{field}.size_bytes",
            )
        offset = 0
        with path.open("rb") as f:
            while True:
                block = f.read(_BLOCK)
                last = offset + len(block) >= size
                upload.write(name, offset, block, ref.sha256 if last else "")
                offset += len(block)
                if last:
                    break
