"""A deposed leader publishes nothing: the version a publish allocates and the live record it
writes carry the leader's epoch (store/adapters.py); a sampler made from a checkpoint serves
a request any replica takes, and is not fenced (real Redis: one server and a Cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.contract import AdapterId
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.catalog import Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.ledger import Claim
from lorafleet_controller.publish import Publisher
from lorafleet_controller.samplers import Samplers
from lorafleet_controller.store import StaleEpoch, Store
from lorafleet_controller.store.adapters import AdaptersRepo, LiveVersion

from .conftest import Domain

K = controller_pb2


def publisher(domain: Domain, store: Store, root: Path, pool: Pool) -> Publisher:
    catalog = Catalog(store, domain.clock)
    samplers = Samplers(store, domain.ledger, domain.registry, pool, domain.settings)
    return Publisher(
        store,
        root,
        domain.registry,
        catalog,
        samplers,
        pool,
        2,
        rollout_wait_seconds=domain.settings.rollout_wait_seconds,
    )


async def test_a_deposed_leader_cannot_publish(domain: Domain, tmp_path: Path) -> None:
    rid = await domain.ready_registration()
    rec = await domain.registry.get_any(rid)
    assert rec is not None
    newer = Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups)
    await newer.take_epoch()
    pool = Pool(retry_seconds=1, timeout=5)
    claim = Claim(
        operation_id=f"{rid}#1",
        registration_id=rid,
        seq_id=1,
        kind=K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
        payload=b"",
        replica=rec.replica,
        slot=rec.slot,
        dirty=False,
        base_model=rec.base_model,
        tenant="t1",
        submitted_at=domain.clock(),
        claim=1,
    )
    try:  # refused before the trainer is asked for anything (none listens at its address)
        with pytest.raises(StaleEpoch):
            await publisher(domain, domain.store, tmp_path, pool).publish(
                claim, K.SaveWeightsForSamplerPayload()
            )
    finally:
        await pool.close()
    old, new = AdaptersRepo(domain.store), AdaptersRepo(newer)
    live = LiveVersion(
        common_pb2.AdapterRef(registration_id=rid, version=1),
        rec.base_model,
        rec.lora,
        str(tmp_path / "v1"),
        {},
    )
    with pytest.raises(StaleEpoch):
        await old.record_live(live, 0.0, fenced=True)
    assert await new.live(str(AdapterId(rid, 1))) is None
    assert await new.live_ids(rec.base_model) == []
    # The new leader allocates the version the deposed one could not, once per operation.
    assert await new.allocate_version(rid, claim.operation_id, fenced=True) == 1
    assert await new.allocate_version(rid, claim.operation_id, fenced=True) == 1
    await new.record_live(live, 0.0, fenced=True)
    assert await new.live(str(AdapterId(rid, 1))) == live
    # A sampler from a checkpoint is a request: any replica, unfenced, takes a new version.
    assert await old.allocate_version(rid, "", fenced=False) == 2
