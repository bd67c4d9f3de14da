"""A retired run's records are forgotten after the retention (issue 36 item 4; real Redis: one
server and a Cluster): once it retired `retired_run_retention_seconds` ago, its operation
records were purged and no checkpoint of it is left, its record, its place in the fleet's and
its tenant's runs and its newest published version go. Before this, every retired run stayed
in Redis forever."""

from __future__ import annotations

from pathlib import Path

from lorafleet import errors
from lorafleet.contract import AdapterId
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.catalog import Catalog
from lorafleet_controller.store import RegState
from lorafleet_controller.store.adapters import AdaptersRepo, LiveVersion
from lorafleet_controller.store.placement import HomesRepo

from .conftest import Domain
from .test_catalog import add

RETENTION = 30 * 86400.0
K = controller_pb2


async def test_a_retired_run_is_forgotten_after_its_retention_once_no_checkpoint_is_left(
    domain: Domain, tmp_path: Path
) -> None:
    catalog, adapters = Catalog(domain.store, domain.clock), AdaptersRepo(domain.store)
    live = await domain.ready_registration(seq=1)
    before = set(await domain.client.keys("*"))
    rid = await domain.ready_registration()
    await domain.ledger.submit("t1", rid, 1, K.OPERATION_KIND_FORWARD_BACKWARD, b"p", "d")
    ref = common_pb2.AdapterRef(registration_id=rid, version=1)
    version = LiveVersion(ref, "tiny", common_pb2.LoraConfig(rank=4), str(tmp_path), {}, "t1")
    await adapters.record_live(version, domain.clock(), fenced=False)
    homes = HomesRepo(domain.store)
    await homes.set("tiny", {rid: "rollout-0", live: "rollout-0"})  # retired with its session:
    checkpoint = f"tinker://{rid}/weights/kept"  # its home was never forgotten (soak test)
    await add(catalog, checkpoint, 0)

    await domain.ledger.fence(rid, RegState.RETIRED, errors.FailedPrecondition("retired"))
    await domain.registry.release(rid)
    domain.clock.now += RETENTION - 1
    assert await domain.registry.expire_retired(RETENTION) == 0  # within the retention
    domain.clock.now += 1
    await domain.ledger.sweep()  # its operation records go once their results are past the TTL
    assert await domain.registry.expire_retired(RETENTION) == 0  # a checkpoint of it is left
    assert (await domain.registry.get("t1", rid)).state == RegState.RETIRED

    await catalog.delete("t1", checkpoint)
    assert await domain.registry.expire_retired(RETENTION) == 1
    assert await domain.registry.get_any(rid) is None
    assert rid not in await domain.registry.all_ids()
    assert await homes.all("tiny") == {live: "rollout-0"}
    assert [r.registration_id for r in (await domain.registry.of_tenant("t1", 10, 0))[0]] == [live]
    # its newest version is let go with it, and collected like any other (test_version_gc)
    unheld = await adapters.unheld(domain.clock(), 10)
    assert unheld == [str(AdapterId(rid, 1))]
    assert await adapters.collect(unheld[0], domain.clock(), "{}") == "collected"
    left = {k for k in set(await domain.client.keys("*")) - before if rid.encode() in k}
    assert left == set(), left
    assert await domain.registry.expire_retired(RETENTION) == 0  # nothing left to forget
    assert (await domain.registry.get("t1", live)).state == RegState.READY
