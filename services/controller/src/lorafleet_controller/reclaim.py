"""Deleted and expired checkpoints leave the shared disk, not only the catalog.

Removing a checkpoint's record (a delete, or its TTL running out) queues its folder in the
same script (store/catalog.py, `Reclaim`); the leader's sweep removes the folders whose time
has come. A folder waits:
- `checkpoint_reclaim_grace_seconds` after its removal, so an operation dispatched before it
  (a load_state, a download, a sampler made from it) finishes reading first;
- while a run's replay log names it (a load_state since the run's last snapshot,
  store/recovery_log.py): rebuilding that run after a trainer loss reads it again, so the
  files stay until the run's next snapshot covers the load, or the run is retired.

Removal never follows a link and never takes another checkpoint's files: the folder is
skipped when it is a symbolic link, and a training checkpoint's when its manifest.json is
no longer the one the removed record named (a checkpoint saved again under the name). It
is first renamed aside (`.reclaim-*`), so no reader ever sees a half-removed checkpoint
under its name; a controller killed mid-way leaves that aside folder, which the next pass
removes, since the entry is forgotten only once the folder is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from lorafleet.digests import sha256_file
from lorafleet.manifests import MANIFEST
from lorafleet_controller.store import Store
from lorafleet_controller.store.catalog import TRAINING, CatalogRepo, Reclaim
from lorafleet_controller.store.recovery_log import RecoveryLog

log = logging.getLogger(__name__)

ASIDE_PREFIX = ".reclaim-"
# A pass reads every run's replay log for what it holds; with folders waiting, at most this
# often (or each grace period, when shorter).
PASS_SECONDS = 30.0


class Reclaimer:
    def __init__(
        self, store: Store, grace_seconds: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.repo = CatalogRepo(store)
        self.replay = RecoveryLog(store)
        self.grace = grace_seconds
        self.clock = clock
        self._next_pass = 0.0

    async def reclaim_due(self) -> int:
        """Remove the queued folders whose time has come and no replay holds (the leader's
        sweep, at most every PASS_SECONDS); the number removed."""
        now = self.clock()
        if now < self._next_pass:
            return 0
        due = [e for e in await self.repo.reclaiming() if e.removed_at + self.grace <= now]
        if not due:
            return 0
        self._next_pass = now + min(PASS_SECONDS, self.grace)
        held = await self.replay.loaded_by_any()
        removed = 0
        for entry in due:
            if entry.tinker_path in held:
                continue
            await asyncio.to_thread(remove_folder, entry)
            await self.repo.reclaimed(entry)
            removed += 1
        return removed


def remove_folder(entry: Reclaim) -> None:
    """Blocking: remove the entry's folder unless it is a link or now another checkpoint's
    (module docstring); gone already is done."""
    folder = Path(entry.folder)
    for aside in folder.parent.glob(f"{ASIDE_PREFIX}{folder.name}-*"):
        shutil.rmtree(aside, ignore_errors=True)  # an earlier pass's, cut short
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        log.warning("not reclaiming %s: not a folder (a link?)", folder)
        return
    if entry.type == TRAINING and _manifest_sha(folder) != entry.manifest.sha256:
        log.info("not reclaiming %s: it holds another checkpoint now", folder)
        return
    aside = folder.with_name(f"{ASIDE_PREFIX}{folder.name}-{uuid.uuid4().hex}")
    os.rename(folder, aside)
    shutil.rmtree(aside)
    log.info("reclaimed %s (%s, %d bytes)", folder, entry.tinker_path, entry.size_bytes)


def _manifest_sha(folder: Path) -> str:
    try:
        return sha256_file(folder / MANIFEST)
    except OSError:
        return ""
