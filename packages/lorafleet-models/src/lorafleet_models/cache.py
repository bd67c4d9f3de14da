"""Build a folder once: temp folder + rename, under an exclusive lock file.

The lock makes concurrent callers (pytest-xdist workers, several services starting together)
wait for the first build instead of repeating it; the rename makes the folder appear whole, so
a reader never sees half-written files. A folder counts as complete when its marker file (the
build record, written last) exists.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(final: Path, build: Callable[[Path], object], marker: str) -> Path:
    """Return `final`, first running `build(empty_temp_dir)` and renaming it there if needed."""
    final = Path(final)
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / marker).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by users
            if final.exists():
                # Without its marker the folder is debris (say, an interrupted manual copy);
                # under the lock nobody else is writing it, so it is safe to replace.
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
