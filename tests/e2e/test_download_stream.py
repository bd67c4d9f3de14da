"""Checkpoint files through the real gateway and controller. Downloads: the bytes stream from
disk in chunks (a 1 GiB adapter moves neither process's peak memory by more than 64 MiB),
each file is checked against the checkpoint's manifest, and a file that fails the check cuts
the HTTP response off instead of finishing it (issue 36 item 5). Deletes: a deleted
checkpoint's files leave the shared disk, a training state's at once and a sampler export's
with its published version (issue 36 item 4; this fleet reclaims without a grace period)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import shutil
import struct
import tarfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import httpx
import pytest

from lorafleet import manifests
from lorafleet.digests import FileDigest, sha256_file
from lorafleet.testing import peak_rss, reset_peak_rss, wait_until
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import Store, connect

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
T = TypeVar("T")
BIG_BYTES = 1 << 30
RSS_MARGIN = 64 << 20


@pytest.fixture(scope="module")
def fleet(make_fleet: Any) -> Iterator[Any]:
    """A fleet of its own: these tests edit a checkpoint's files and watch processes' memory."""
    no_grace = {"LORAFLEET_CONTROLLER_CHECKPOINT_RECLAIM_GRACE_SECONDS": "0"}
    with make_fleet(trainers=1, rollouts=0, slots=2, extra_env={"controller": no_grace}) as running:
        yield running


class Api:
    def __init__(self, fleet: Any) -> None:
        self.http = httpx.Client(
            base_url=f"{fleet.base_url}/api/v1", headers={"X-API-Key": fleet.api_key}, timeout=120
        )

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.http.post(path, json=body)
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        def answered() -> dict[str, Any] | None:
            out = self.post("/retrieve_future", {"request_id": request["request_id"]})
            return None if out.get("type") == "try_again" else out

        return wait_until(answered, f"{request['request_id']} finished")


@pytest.fixture(scope="module")
def saved(fleet: Any) -> dict[str, Any]:
    """A training run and a checkpoint the trainer saved: its run id, name and folder."""
    api = Api(fleet)
    caps = api.http.get("/get_server_capabilities").json()["supported_models"]
    session = api.post("/create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": caps[0]["model_name"]}
    created = api.post("/create_model", {**body, "lora_config": {"rank": 4}})
    rid = api.result(created)["model_id"]
    save = api.post("/save_weights", {"model_id": rid, "path": "a", "seq_id": 1})
    assert api.result(save)["path"] == f"tinker://{rid}/weights/a"
    folder = fleet.config.run_dir / "storage" / rid / "a"
    assert (folder / manifests.MANIFEST).is_file()
    return {"api": api, "rid": rid, "folder": folder}


def signed(api: Api, rid: str, name: str) -> tuple[str, dict[str, str]]:
    """(tar URL, file name -> URL) of a checkpoint, as 0.24.1 and 0.38 ask for them."""
    checkpoint = f"/training_runs/{rid}/checkpoints/weights/{name}"
    archive = api.http.get(f"{checkpoint}/archive")
    assert archive.status_code == 200, archive.text
    files = api.http.get(f"{checkpoint}/external_weights_urls")
    assert files.status_code == 200, files.text
    return archive.json()["url"], files.json()["urls"]


def test_download_streams_every_file_checked(saved: dict[str, Any]) -> None:
    api, folder = saved["api"], saved["folder"]
    tar_url, urls = signed(api, saved["rid"], "a")
    assert set(urls) == {CONFIG, WEIGHTS}
    raw = httpx.get(tar_url, timeout=60)
    assert raw.status_code == 200 and "content-length" not in raw.headers
    with tarfile.open(fileobj=io.BytesIO(raw.content)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert members == {
        CONFIG: (folder / CONFIG).read_bytes(),
        WEIGHTS: (folder / WEIGHTS).read_bytes(),
        "checkpoint_complete": b"",
    }
    one = httpx.get(urls[WEIGHTS], timeout=60)
    assert one.status_code == 200 and one.content == (folder / WEIGHTS).read_bytes()
    assert one.headers["content-length"] == str((folder / WEIGHTS).stat().st_size)


def test_a_deleted_checkpoint_leaves_the_disk(fleet: Any, saved: dict[str, Any]) -> None:
    """Deleted through the REST API: the record at once, a saved state's folder by the
    leader's next sweeps. A sampler export's folder is its published version's: it stays
    while that is the run's newest (inflight samplers follow it), and goes once a newer
    version supersedes it with nothing else holding it. The run's other checkpoint stays."""
    api, rid = saved["api"], saved["rid"]
    state = api.result(api.post("/save_weights", {"model_id": rid, "path": "gone", "seq_id": 2}))
    export = api.result(
        api.post("/save_weights_for_sampler", {"model_id": rid, "path": "gone", "seq_id": 3})
    )
    served, folder = _folder(fleet, export["path"]), _folder(fleet, state["path"])
    assert served.is_dir() and folder.is_dir()
    for path in (export["path"], state["path"]):
        kind, name = path.split("/")[-2:]
        reply = api.http.delete(f"/training_runs/{rid}/checkpoints/{kind}/{name}")
        assert reply.status_code == 200, reply.text
        assert api.http.get(f"/training_runs/{rid}/checkpoints/{kind}/{name}").status_code == 404
    wait_until(lambda: not folder.exists(), "the saved state's folder reclaimed")
    assert on_catalog(fleet, lambda catalog: catalog.repo.reclaiming()) == []
    assert served.is_dir() and (saved["folder"] / WEIGHTS).is_file()
    newer = api.result(
        api.post("/save_weights_for_sampler", {"model_id": rid, "path": "newer", "seq_id": 4})
    )
    wait_until(lambda: not served.exists(), "the superseded version's folder reclaimed")
    assert _folder(fleet, newer["path"]).is_dir() and (saved["folder"] / WEIGHTS).is_file()


def _folder(fleet: Any, tinker_path: str) -> Path:
    """Where the catalog says a checkpoint's files lie."""

    rec = on_catalog(fleet, lambda catalog: catalog.get(fleet.config.tenant, tinker_path))
    return Path(rec.files_dir or unquote(urlparse(rec.manifest.uri).path))


def on_catalog(fleet: Any, call: Callable[[Catalog], Awaitable[T]]) -> T:
    """`call` on a Catalog over the fleet's Redis, as the controller reads and writes it."""

    async def run() -> T:
        defaults = ControllerSettings()
        store = Store(connect(fleet.redis_url), defaults.key_prefix, defaults.ledger_groups)
        try:
            return await call(Catalog(store))
        finally:
            await store.close()

    return asyncio.run(run())


def write_zeros_safetensors(path: Path, size: int) -> None:
    """A valid safetensors file of exactly `size` bytes: one float32 tensor of zeros, left
    sparse (no disk space, no writing time); its header padded with spaces to fit."""
    floats = (size - 8 - 256) // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [floats], "data_offsets": [0, floats * 4]}})
    header = header.ljust(size - 8 - floats * 4)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(size)


def add_checkpoint(fleet: Any, saved: dict[str, Any], name: str, size: int) -> Path:
    """`weights/<name>`: the saved checkpoint's folder with an adapter_model.safetensors of
    `size` bytes and its manifest rewritten for it, recorded in the catalog as a save
    records it."""
    big = saved["folder"].parent / name
    shutil.copytree(saved["folder"], big)
    write_zeros_safetensors(big / WEIGHTS, size)
    listed = {
        p.name: FileDigest(sha256_file(p), p.stat().st_size)
        for p in big.iterdir()
        if p.name != manifests.MANIFEST
    }
    (big / manifests.MANIFEST).write_text(json.dumps(manifests.render(listed)))

    async def record(catalog: Catalog) -> None:
        real = await catalog.get(fleet.config.tenant, f"tinker://{saved['rid']}/weights/a")
        await catalog.add(
            tinker_path=f"tinker://{saved['rid']}/weights/{name}",
            tenant=real.tenant,
            type=TRAINING,
            base_model=real.base_model,
            lora=real.lora,
            manifest=common_pb2.BlobRef(
                uri=big.resolve().as_uri(), sha256=sha256_file(big / manifests.MANIFEST)
            ),
            has_optimizer=True,
        )

    on_catalog(fleet, record)
    return big


def test_a_file_that_fails_its_check_never_arrives_whole(fleet: Any, saved: dict[str, Any]) -> None:
    """Found before the first byte (a one-chunk file, a link): a status code naming the field.
    Found after bytes went out (a file of several chunks whose last bytes differ): the
    response is cut off, so neither a tar nor a Content-Length reads as complete."""
    api, folder = saved["api"], saved["folder"]
    size = 3 * (1 << 20) + 4096
    several = add_checkpoint(fleet, saved, "several", size)
    tar_url, urls = signed(api, saved["rid"], "several")
    with (several / WEIGHTS).open("r+b") as f:  # the same size: found at the end only
        f.seek(size - 1)
        f.write(b"\1")
    received: dict[str, int] = {}
    for url in (tar_url, urls[WEIGHTS]):
        got = 0
        with pytest.raises(httpx.RemoteProtocolError), httpx.stream("GET", url) as reply:
            assert reply.status_code == 200  # the headers went out before the bytes
            for part in reply.iter_bytes():
                got += len(part)
        received[url] = got
    assert (1 << 20) <= received[urls[WEIGHTS]] < size  # bytes went out, not all of them
    assert (1 << 20) <= received[tar_url] < size
    tar_url, urls = signed(api, saved["rid"], "a")
    original = (folder / WEIGHTS).read_bytes()
    try:
        (folder / WEIGHTS).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        reply = httpx.get(urls[WEIGHTS], timeout=60)
        assert reply.status_code == 400 and reply.json()["field"] == "tinker_path", reply.text
        (folder / WEIGHTS).unlink()
        (folder / WEIGHTS).symlink_to(several / WEIGHTS)
        for url in (tar_url, urls[WEIGHTS]):
            reply = httpx.get(url, timeout=60)
            assert reply.status_code == 400, reply.text
            assert reply.json()["field"] == "tinker_path" and "symbolic link" in reply.text
    finally:
        (folder / WEIGHTS).unlink()
        (folder / WEIGHTS).write_bytes(original)
        shutil.rmtree(several)
    assert httpx.get(urls[WEIGHTS], timeout=60).content == original  # served again


@pytest.mark.slow
def test_a_1_gib_download_keeps_controller_and_gateway_memory_flat(
    fleet: Any, saved: dict[str, Any]
) -> None:
    big = add_checkpoint(fleet, saved, "big", BIG_BYTES)
    try:
        expected = sha256_file(big / WEIGHTS)
        tar_url, urls = signed(saved["api"], saved["rid"], "big")
        pids = {name: fleet.member(name).proc.pid for name in ("controller", "gateway")}
        for url in (urls[WEIGHTS], tar_url):
            idle = {name: reset_peak_rss(pid) for name, pid in pids.items()}
            digest, received = hashlib.sha256(), 0
            with httpx.stream("GET", url, timeout=120) as reply:
                assert reply.status_code == 200
                for part in reply.iter_bytes(1 << 20):
                    if url == urls[WEIGHTS]:
                        digest.update(part)
                    received += len(part)
            grown = {n: peak_rss(p) - idle[n] for n, p in pids.items()}
            assert all(g < RSS_MARGIN for g in grown.values()), (url, grown)
            assert received >= BIG_BYTES
            if url == urls[WEIGHTS]:
                assert received == BIG_BYTES and digest.hexdigest() == expected
    finally:
        shutil.rmtree(big)
