"""The checkpoint catalog's writes (store/catalog.py, real Redis: one server and a Cluster):
the expiry sweep is the leader's and a deposed leader's is refused; an update racing a
delete does not bring the record back."""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.store import StaleEpoch, Store

from .conftest import Domain


async def add(
    catalog: Catalog, path: str, ttl: float, manifest: common_pb2.BlobRef | None = None
) -> None:
    assert await catalog.add(
        tinker_path=path,
        tenant="t1",
        type=TRAINING,
        base_model="tiny",
        lora=common_pb2.LoraConfig(rank=4),
        ttl_seconds=ttl,
        manifest=manifest,
    )


async def test_a_deposed_leader_cannot_sweep_expired_checkpoints(domain: Domain) -> None:
    rid = await domain.ready_registration()
    path = f"tinker://{rid}/weights/a"
    old = Catalog(domain.store, domain.clock)
    await add(old, path, ttl=10)
    newer = Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups)
    await newer.take_epoch()
    new = Catalog(newer, domain.clock)
    domain.clock.now += 11
    with pytest.raises(StaleEpoch):
        await old.sweep_expired()
    assert (await new.repo.load(path)) is not None  # nothing removed
    assert await new.sweep_expired() == 1
    assert await new.repo.load(path) is None
    assert await new.repo.paths("t1") == [] and await new.repo.paths("t1", rid) == []
    assert await new.repo.expired(domain.clock()) == []


async def test_update_changes_visibility_and_expiry_but_never_revives(domain: Domain) -> None:
    rid = await domain.ready_registration()
    path = f"tinker://{rid}/weights/b"
    catalog = Catalog(domain.store, domain.clock)
    await add(catalog, path, ttl=0)
    rec = await catalog.update("t1", path, public=True, ttl_seconds=5, clear_ttl=False)
    assert rec.public and rec.expires_at == domain.clock() + 5
    assert await catalog.repo.expired(domain.clock() + 5) == [path]
    rec = await catalog.update("t1", path, public=None, ttl_seconds=None, clear_ttl=True)
    assert rec.public and rec.expires_at == 0
    assert await catalog.repo.expired(domain.clock() + 5) == []
    await catalog.delete("t1", path)
    await catalog.repo.update(path, public=False, expires_at=domain.clock() + 5)  # too late
    assert await catalog.repo.load(path) is None
    assert await catalog.repo.expired(domain.clock() + 5) == []
    with pytest.raises(errors.NotFound):
        await catalog.get("t1", path)
