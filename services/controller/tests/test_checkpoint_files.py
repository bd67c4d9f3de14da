"""A checkpoint's files leave the controller only as the bytes its catalog record names: streamed
from disk in blocks (DownloadCheckpoint) or copied block by block into a sampler's version,
checked against the manifest's SHA-256s on the way, never through a symbolic link or from a
folder elsewhere (catalog.py; real Redis, real files on disk)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lorafleet import errors, manifests
from lorafleet.contract import AdapterId
from lorafleet.digests import BLOCK_BYTES, FileDigest, sha256_file
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import SAMPLER, TRAINING, Catalog, CheckpointRecord
from lorafleet_controller.clients import Pool
from lorafleet_controller.publish import Publisher
from lorafleet_controller.samplers import Samplers
from lorafleet_controller.store.adapters import AdaptersRepo

from .conftest import Domain

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WEIGHTS_BYTES = os.urandom(2 * BLOCK_BYTES + 12345)  # three blocks, the last one short


def write_state(folder: Path) -> common_pb2.BlobRef:
    """A saved state as the trainer writes it: the files, then manifest.json listing them."""
    folder.mkdir(parents=True)
    (folder / CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (folder / WEIGHTS).write_bytes(WEIGHTS_BYTES)
    (folder / "trainer_state.json").write_text("{}")
    listed = {p.name: FileDigest(sha256_file(p), p.stat().st_size) for p in folder.iterdir()}
    (folder / manifests.MANIFEST).write_text(json.dumps(manifests.render(listed)))
    return common_pb2.BlobRef(
        uri=folder.resolve().as_uri(), sha256=sha256_file(folder / manifests.MANIFEST)
    )


async def training_checkpoint(domain: Domain, folder: Path, name: str = "a") -> CheckpointRecord:
    rid = await domain.ready_registration()
    catalog = Catalog(domain.store, domain.clock)
    path = f"tinker://{rid}/weights/{name}"
    await catalog.add(
        tinker_path=path,
        tenant="t1",
        type=TRAINING,
        base_model="tiny",
        lora=common_pb2.LoraConfig(rank=4),
        manifest=write_state(folder),
    )
    return await catalog.get("t1", path)


async def download(domain: Domain, rec: CheckpointRecord) -> list[common_pb2.FileChunk]:
    return [c async for c in Catalog(domain.store, domain.clock).chunks(rec)]


def joined(chunks: list[common_pb2.FileChunk], name: str) -> bytes:
    return b"".join(c.data for c in chunks if c.path == name)


async def test_a_download_streams_each_file_in_blocks_with_its_size_and_digest(
    domain: Domain, tmp_path: Path
) -> None:
    rec = await training_checkpoint(domain, tmp_path / "state")
    chunks = await download(domain, rec)
    weights = [c for c in chunks if c.path == WEIGHTS]
    assert [c.offset for c in weights] == [0, BLOCK_BYTES, 2 * BLOCK_BYTES]
    assert weights[0].size_bytes == len(WEIGHTS_BYTES) and weights[1].size_bytes == 0
    assert [bool(c.sha256) for c in weights] == [False, False, True]
    assert weights[-1].sha256 == sha256_file(tmp_path / "state" / WEIGHTS)
    assert joined(chunks, WEIGHTS) == WEIGHTS_BYTES
    assert joined(chunks, CONFIG) == (tmp_path / "state" / CONFIG).read_bytes()
    assert {c.path for c in chunks} == {CONFIG, WEIGHTS}  # the adapter, not the whole state
    listed = [c async for c in Catalog(domain.store, domain.clock).chunks(rec, names_only=True)]
    assert [(c.path, c.size_bytes, c.data) for c in listed] == [
        (CONFIG, (tmp_path / "state" / CONFIG).stat().st_size, b""),
        (WEIGHTS, len(WEIGHTS_BYTES), b""),
    ]


async def refused(domain: Domain, rec: CheckpointRecord, reason: str) -> None:
    """Refused before the first chunk: the gateway answers a status code, not a cut-off body."""
    chunks = Catalog(domain.store, domain.clock).chunks(rec)
    with pytest.raises(errors.FailedPrecondition) as err:
        await anext(chunks)
    assert (err.value.field, err.value.reason) == ("tinker_path", reason), err.value


async def test_a_symbolic_link_is_refused_wherever_it_points(
    domain: Domain, tmp_path: Path
) -> None:
    folder = tmp_path / "state"
    rec = await training_checkpoint(domain, folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(folder / WEIGHTS, elsewhere / WEIGHTS)  # the very bytes the manifest names
    (folder / WEIGHTS).symlink_to(elsewhere / WEIGHTS)
    await refused(domain, rec, "UNSAFE_PATH")
    (folder / WEIGHTS).unlink()
    shutil.move(elsewhere / WEIGHTS, folder / "weights.bin")
    (folder / WEIGHTS).symlink_to(folder / "weights.bin")  # inside its folder: refused too
    await refused(domain, rec, "UNSAFE_PATH")


async def test_a_checkpoint_folder_that_lies_elsewhere_is_refused(
    domain: Domain, tmp_path: Path
) -> None:
    rec = await training_checkpoint(domain, tmp_path / "state")
    moved = tmp_path / "other-tenant" / "state"
    moved.parent.mkdir()
    (tmp_path / "state").rename(moved)  # the same files, hashes and all, in another folder
    (tmp_path / "state").symlink_to(moved, target_is_directory=True)
    await refused(domain, rec, "UNSAFE_PATH")


async def test_bytes_that_do_not_match_the_manifest_end_the_stream_before_the_last_chunk(
    domain: Domain, tmp_path: Path
) -> None:
    folder = tmp_path / "state"
    rec = await training_checkpoint(domain, folder)
    with (folder / WEIGHTS).open("r+b") as f:  # same size, one byte changed at the end
        f.seek(len(WEIGHTS_BYTES) - 1)
        f.write(bytes([WEIGHTS_BYTES[-1] ^ 1]))
    got: list[common_pb2.FileChunk] = []
    with pytest.raises(errors.FailedPrecondition) as err:
        async for chunk in Catalog(domain.store, domain.clock).chunks(rec):
            got.append(chunk)
    assert err.value.reason == "DIGEST_MISMATCH" and WEIGHTS in err.value.message
    weights = [c for c in got if c.path == WEIGHTS]
    assert weights and not any(c.sha256 for c in weights)  # streamed, but never finished
    assert len(joined(got, WEIGHTS)) < len(WEIGHTS_BYTES)


async def test_a_size_or_manifest_that_differs_is_refused_before_any_byte(
    domain: Domain, tmp_path: Path
) -> None:
    folder = tmp_path / "state"
    rec = await training_checkpoint(domain, folder)
    with (folder / WEIGHTS).open("ab") as f:
        f.write(b"\0")
    await refused(domain, rec, "DIGEST_MISMATCH")
    (folder / WEIGHTS).write_bytes(WEIGHTS_BYTES)
    assert len(await download(domain, rec)) == 4  # restored: served again
    manifest = json.loads((folder / manifests.MANIFEST).read_text())
    manifest["files"][WEIGHTS]["sha256"] = "0" * 64  # an edited manifest
    (folder / manifests.MANIFEST).write_text(json.dumps(manifest))
    await refused(domain, rec, "DIGEST_MISMATCH")


async def test_a_sampler_checkpoint_is_checked_against_the_digests_it_was_recorded_with(
    domain: Domain, tmp_path: Path
) -> None:
    rid = await domain.ready_registration()
    folder = tmp_path / "sampler"
    write_state(folder)
    catalog = Catalog(domain.store, domain.clock)
    digests = {
        n: FileDigest(sha256_file(folder / n), (folder / n).stat().st_size)
        for n in (CONFIG, WEIGHTS)
    }
    for name, files in (("ok", digests), ("unrecorded", {})):
        await catalog.add(
            tinker_path=f"tinker://{rid}/sampler_weights/{name}",
            tenant="t1",
            type=SAMPLER,
            base_model="tiny",
            lora=common_pb2.LoraConfig(rank=4),
            files_dir=str(folder),
            version=1,
            files=files,
        )
    rec = await catalog.get("t1", f"tinker://{rid}/sampler_weights/ok")
    assert rec.files == digests  # stored and read back
    assert joined(await download(domain, rec), WEIGHTS) == WEIGHTS_BYTES
    unrecorded = await catalog.get("t1", f"tinker://{rid}/sampler_weights/unrecorded")
    await refused(domain, unrecorded, "NO_DIGEST")
    (folder / CONFIG).write_text(json.dumps({"r": 8, "lora_alpha": 8}))  # same size, edited
    with pytest.raises(errors.FailedPrecondition, match=CONFIG):
        await download(domain, rec)


def publisher(domain: Domain, storage: Path, shared: Path | None, pool: Pool) -> Publisher:
    catalog = Catalog(domain.store, domain.clock)
    samplers = Samplers(domain.store, domain.ledger, domain.registry, pool, domain.settings)
    return Publisher(
        domain.store,
        storage,
        domain.registry,
        catalog,
        samplers,
        pool,
        2,
        shared,
        rollout_wait_seconds=domain.settings.rollout_wait_seconds,
    )


@pytest.mark.parametrize("shared", [False, True], ids=["storage-root", "shared-root"])
async def test_a_sampler_from_a_checkpoint_copies_only_checked_bytes(
    domain: Domain, tmp_path: Path, shared: bool
) -> None:
    folder = tmp_path / "state"
    rec = await training_checkpoint(domain, folder)
    rid = rec.training_run_id
    storage, shared_root = tmp_path / "storage", (tmp_path / "shared") if shared else None
    pool = Pool(retry_seconds=1, timeout=5)  # no rollout is up: the version stays live only
    pub = publisher(domain, storage, shared_root, pool)
    adapters = (shared_root or storage) / "adapters" / rid
    try:
        with (folder / WEIGHTS).open("r+b") as f:
            f.write(bytes([WEIGHTS_BYTES[0] ^ 1]))
        with pytest.raises(errors.FailedPrecondition, match="SHA-256"):
            await pub.sampler_from_checkpoint(rec, "s1:sample:0", "t1", rec.tinker_path)
        assert not adapters.exists() or not any(adapters.iterdir())  # no folder, half or whole
        assert await AdaptersRepo(domain.store).live_ids("tiny") == []
        (folder / WEIGHTS).unlink()
        (folder / WEIGHTS).symlink_to(tmp_path / "nowhere")
        with pytest.raises(errors.FailedPrecondition, match="symbolic link"):
            await pub.sampler_from_checkpoint(rec, "s1:sample:0", "t1", rec.tinker_path)
        (folder / WEIGHTS).unlink()
        (folder / WEIGHTS).write_bytes(WEIGHTS_BYTES)
        sampler = await pub.sampler_from_checkpoint(rec, "s1:sample:0", "t1", rec.tinker_path)
    finally:
        await pool.close()
    live = await AdaptersRepo(domain.store).live(str(AdapterId(rid, sampler.ref.version)))
    assert live is not None
    assert (Path(live.folder) / WEIGHTS).read_bytes() == WEIGHTS_BYTES
    assert bool(live.refs) == shared
