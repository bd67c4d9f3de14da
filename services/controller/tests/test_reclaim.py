"""A deleted or expired checkpoint's files leave the disk (reclaim.py; real Redis: one server
and a Cluster, real folders): after the grace period, never while a run's replay may load
them, never another checkpoint's under the same name, never through a link (issue 36 item 4)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.catalog import Catalog
from lorafleet_controller.reclaim import PASS_SECONDS, Reclaimer
from lorafleet_controller.recovery import Recovery

from .conftest import Domain
from .test_catalog import add

GRACE = 600.0
K = controller_pb2


def state_folder(root: Path, rid: str, name: str, content: bytes = b"weights") -> Path:
    """A saved state's folder as a trainer writes it: files and a manifest.json."""
    folder = root / rid / name
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(content)
    (folder / "manifest.json").write_text(f'{{"files": "{hashlib.sha256(content).hexdigest()}"}}')
    return folder


async def saved(catalog: Catalog, folder: Path, rid: str, ttl: float = 0) -> str:
    path = f"tinker://{rid}/weights/{folder.name}"
    sha = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    await add(catalog, path, ttl, common_pb2.BlobRef(uri=folder.as_uri(), sha256=sha))
    return path


def parts(domain: Domain) -> tuple[Catalog, Reclaimer]:
    return Catalog(domain.store, domain.clock), Reclaimer(domain.store, GRACE, domain.clock)


async def test_deleted_and_expired_checkpoints_leave_the_disk_after_the_grace(
    domain: Domain, tmp_path: Path
) -> None:
    catalog, reclaimer = parts(domain)
    rid = await domain.ready_registration()
    deleted = state_folder(tmp_path, rid, "deleted")
    expiring = state_folder(tmp_path, rid, "expiring")
    kept = state_folder(tmp_path, rid, "kept")
    path = await saved(catalog, deleted, rid)
    await saved(catalog, expiring, rid, ttl=60)
    await saved(catalog, kept, rid)

    await catalog.delete("t1", path)
    domain.clock.now += 61
    assert await catalog.sweep_expired() == 1
    assert await catalog.repo.load(path) is None
    assert await reclaimer.reclaim_due() == 0  # within the grace: still on disk
    assert deleted.is_dir() and expiring.is_dir()
    domain.clock.now += GRACE
    assert await reclaimer.reclaim_due() == 2
    assert not deleted.exists() and not expiring.exists() and kept.is_dir()
    assert sorted(p.name for p in (tmp_path / rid).iterdir()) == ["kept"]  # nothing set aside
    assert await catalog.repo.reclaiming() == []


async def test_a_checkpoint_a_replay_may_load_stays_until_the_next_snapshot(
    domain: Domain, tmp_path: Path
) -> None:
    """A run that loaded the checkpoint since its snapshot would read it again when rebuilt
    after a trainer loss: its files, and its manifest for the replay, outlast the record."""
    catalog, reclaimer = parts(domain)
    recovery = Recovery(domain.store, catalog.manifest_for, _no_retire)
    rid = await domain.ready_registration()
    folder = state_folder(tmp_path, rid, "loaded")
    path = await saved(catalog, folder, rid)
    manifest = await catalog.manifest_for(path)
    load = K.OperationPayload(load_state=K.LoadStatePayload(path=path, with_optimizer=True))
    await recovery.log([(rid, 3, K.OPERATION_KIND_LOAD_STATE, load.SerializeToString())])

    await catalog.delete("t1", path)
    domain.clock.now += GRACE + 1
    assert await reclaimer.reclaim_due() == 0
    assert folder.is_dir() and await catalog.manifest_for(path) == manifest
    plan = await recovery.plan(rid)  # the replay still has what it loads
    assert [seq for seq, _ in plan.ops] == [3]

    await recovery.record_page(rid, 3, common_pb2.BlobRef(uri="file:///states/snap"))
    assert await reclaimer.reclaim_due() == 0  # one pass per PASS_SECONDS
    domain.clock.now += PASS_SECONDS
    assert await reclaimer.reclaim_due() == 1
    assert not folder.exists() and await catalog.manifest_for(path) is None


async def test_reclaiming_spares_a_new_checkpoint_of_the_name_and_links(
    domain: Domain, tmp_path: Path
) -> None:
    catalog, reclaimer = parts(domain)
    rid = await domain.ready_registration()
    again = state_folder(tmp_path, rid, "again")
    linked = state_folder(tmp_path, rid, "linked")
    outside = state_folder(tmp_path / "elsewhere", rid, "target")
    first = await saved(catalog, again, rid)
    await saved(catalog, linked, rid)
    await catalog.delete("t1", first)
    # Saved again under the name once the old folder was gone by hand: another manifest.
    shutil.rmtree(again)
    state_folder(tmp_path, rid, "again", b"other weights")
    await saved(catalog, again, rid)
    shutil.rmtree(linked)
    linked.symlink_to(outside, target_is_directory=True)
    await catalog.delete("t1", f"tinker://{rid}/weights/linked")

    domain.clock.now += GRACE + 1
    assert await reclaimer.reclaim_due() == 2  # both entries done with, neither removed
    assert (again / "adapter_model.safetensors").read_bytes() == b"other weights"
    assert linked.is_symlink() and (outside / "manifest.json").is_file()
    assert await catalog.repo.reclaiming() == []


async def _no_retire(rid: str, error: object) -> None:
    raise AssertionError(f"{rid} retired: {error}")
