"""Paging leaves no snapshots behind (paging.py, recovery.prune, the trainer's PruneSnapshots):
a run paged out and in again and again keeps one restore point on disk, the one its replay log
points to, its checkpoints stay, its final state is exact, and its retirement removes the rest
(real redis, controller and trainer processes; the trainer snapshots after every step, so the
automatic snapshots of each binding are in play too)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from lorafleet.testing import start_redis, wait_until_async
from lorafleet.v1 import trainer_pb2
from lorafleet_trainer.checkpoint import TRAINER_STATE, resolve_uri
from lorafleet_trainer.snapshots import KEEP, PAGE_MARK, PREFIX

from .fleet import Client, Proc, controller_proc, trainer_proc
from .test_paging import KEYS, SLOTS, Run, same, start_runs

CYCLES = 4


@pytest.fixture
def procs(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[Path, object, Proc]]:
    """Redis, a controller (forced page-outs only) and a 2-slot trainer snapshotting every
    optimizer step."""
    redis = start_redis(tmp_path / "redis")
    controller = controller_proc(redis, tmp_path, LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS="0")
    trainer = trainer_proc(tiny_model_dir, controller.port, tmp_path, "trainer-0", SLOTS)
    trainer.env["LORAFLEET_TRAINER_SNAPSHOT_EVERY_STEPS"] = "1"
    try:
        controller.launch()
        trainer.launch()
        controller.wait()
        trainer.wait()
        yield tmp_path, redis, controller
    finally:
        trainer.stop()
        controller.stop()
        redis.stop()


def restore_points(root: Path, run: Run) -> set[Path]:
    """The run's automatic snapshots and page-out saves on disk."""
    folder = root / run.rid
    return (
        {
            p
            for p in folder.iterdir()
            if p.name.startswith(PREFIX) or saved_by(p).startswith(run.rid + PAGE_MARK)
        }
        if folder.is_dir()
        else set()
    )


def saved_by(folder: Path) -> str:
    return str(json.loads((folder / TRAINER_STATE).read_text()).get("saved_by", ""))


async def logged(r: aioredis.Redis, root: Path, run: Run) -> Path:
    """The folder of the snapshot the run's replay log points to."""
    raw = await r.hget(KEYS.replay(run.rid), "snap")
    assert raw is not None, run.rid
    return resolve_uri(root, trainer_pb2.SlotSnapshot.FromString(raw).manifest.uri)


async def test_a_run_paged_again_and_again_keeps_one_restore_point_and_its_state(procs) -> None:
    tmp, redis_server, controller = procs
    root = tmp / "trainer-states"
    client = Client(controller.port)
    r = aioredis.from_url(redis_server.url)  # type: ignore[attr-defined]
    try:
        reference, paged = await start_runs(client, [9, 9])
        for cycle in range(CYCLES):
            steps = range(2 * cycle, 2 * cycle + 2)
            await reference.steps(steps)
            await paged.steps(steps)  # paged in by its first forward_backward
            await paged.page_out()
            current = await logged(r, root, paged)
            assert saved_by(current).startswith(paged.rid + PAGE_MARK)
            # The page-out's save alone: the earlier ones and every automatic snapshot of
            # the bindings it was paged out of are gone.
            assert restore_points(root, paged) == {current}, cycle
        # Never paged: the trainer keeps its own series as before (one more while the
        # newest is renamed into place and the oldest not yet deleted).
        assert 1 <= len(restore_points(root, reference)) <= KEEP + 1

        # A checkpoint the user saved stays; an orphan of a page-out that died between
        # recording its save and pruning (a copy under another name) goes at the next one.
        same(await paged.state(tmp), await reference.state(tmp))
        saved = root / paged.rid / f"check-{paged.seq}"
        orphan = root / paged.rid / "paged-0-orphan"
        shutil.copytree(await logged(r, root, paged), orphan)
        await paged.page_out()
        assert saved.is_dir() and restore_points(root, paged) == {await logged(r, root, paged)}
        assert not orphan.exists()
        same(await paged.state(tmp), await reference.state(tmp))

        # Retired: no restore point is left (deleted in the background), the user's
        # checkpoints are.
        for run in (paged, reference):
            await run.delete()
            await wait_until_async(
                lambda run=run: not restore_points(root, run), f"{run.rid}'s restore points deleted"
            )
        assert saved.is_dir()
    finally:
        await r.aclose()
        await client.close()
