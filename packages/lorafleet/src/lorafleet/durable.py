"""Folders that survive a power cut: the one way a written folder becomes visible.

A checkpoint, a published adapter version or a paged snapshot is written under a temporary
name and renamed into place, so a reader never sees half of one. That is atomic against a
process dying, not against the machine losing power: the kernel may have written the rename
to disk before the files' data, or not written the rename at all, and after a power cut a
folder the ledger or catalog names can be missing or hold empty files. POSIX makes a write
durable only through fsync, and a directory entry (a created file, a rename) only through
an fsync of the directory that holds it. So `commit_folder` fsyncs every file, then the
temporary folder (its entries), renames it, then fsyncs the parent (the rename); only after
it returns may anything durable (an answer that the controller records, a catalog entry)
name the folder. This is what Jepsen's LazyFS checks: a filesystem that drops every unsynced
byte when it "crashes".
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(folder: Path) -> None:
    """fsync every regular file under `folder`, then each directory after its contents."""
    for parent, _, names in os.walk(folder, topdown=False):
        for name in sorted(names):
            path = Path(parent, name)
            if path.is_file() and not path.is_symlink():
                with path.open("rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(Path(parent))


def commit_folder(tmp: Path, final: Path) -> None:
    """Blocking: make the fully written folder `tmp` durable, rename it to `final` and make
    the rename durable. Raises what `os.rename` raises (an existing non-empty `final`:
    OSError), after which `tmp` is the caller's to remove."""
    fsync_files(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
