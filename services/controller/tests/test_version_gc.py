"""Published versions nothing holds leave Redis and the disk (version_gc.py; real Redis: one
server and a Cluster, real folders): a version stays while a snapshot sampler pins it, a
sampler checkpoint names it or it is its run's newest, and goes a grace after the last of
those went (issue 36 item 4). Before this, every published version stayed forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.contract import AdapterId
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import SAMPLER, Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.reclaim import Reclaimer
from lorafleet_controller.samplers import Samplers
from lorafleet_controller.store.adapters import AdaptersRepo, LiveVersion
from lorafleet_controller.tenancy import Tenancy
from lorafleet_controller.version_gc import VersionCollector

from .conftest import Domain

GRACE = 600.0
LORA = common_pb2.LoraConfig(rank=4)


class Parts:
    def __init__(self, domain: Domain) -> None:
        self.domain = domain
        self.repo = AdaptersRepo(domain.store)
        self.catalog = Catalog(domain.store, domain.clock)
        self.tenancy = Tenancy(domain.store, domain.clock)
        pool = Pool(retry_seconds=1, timeout=5)  # no rollout is registered: none is dialled
        self.samplers = Samplers(
            domain.store, domain.ledger, domain.registry, pool, domain.settings
        )
        self.collector = VersionCollector(domain.store, domain.registry, pool, GRACE, domain.clock)
        self.reclaimer = Reclaimer(domain.store, GRACE, domain.clock)

    async def publish(self, root: Path, rid: str, version: int, sampler_id: str = "") -> Path:
        """A version as publish.py leaves it: its folder written, then recorded live (the
        run's own publish, or with `sampler_id` that sampler's own version)."""
        folder = root / rid / str(version)
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"w%d" % version)
        ref = common_pb2.AdapterRef(registration_id=rid, version=version)
        live = LiveVersion(ref, "tiny", LORA, str(folder), {}, "t1")
        await self.repo.record_live(live, self.domain.clock(), fenced=False, sampler_id=sampler_id)
        return folder

    async def name(self, rid: str, version: int, name: str, folder: Path) -> str:
        path = f"tinker://{rid}/sampler_weights/{name}"
        await self.catalog.add(
            tinker_path=path,
            tenant="t1",
            type=SAMPLER,
            base_model="tiny",
            lora=LORA,
            files_dir=str(folder),
            version=version,
        )
        return path

    async def sampler(self, session: str, n: int, rid: str, version: int) -> str:
        sampler_id = f"{session}:sample:{n}"
        ref = common_pb2.AdapterRef(registration_id=rid, version=version)
        await self.samplers.record(
            sampler_id=sampler_id,
            tenant="t1",
            base_model="tiny",
            model_path="",
            ref=ref,
            inflight=False,
        )
        return sampler_id

    async def collect_after_grace(self) -> int:
        self.domain.clock.now += GRACE
        return await self.collector.collect_due()

    async def published(self, rid: str) -> list[int]:
        """The run's versions recorded live and in the live index."""
        listed = [a for a in await self.repo.live_ids("tiny") if a.registration_id == rid]
        return sorted([a.version for a in listed if await self.repo.live(str(a)) is not None])


async def test_a_version_goes_when_the_last_thing_holding_it_goes(
    domain: Domain, tmp_path: Path
) -> None:
    p = Parts(domain)
    _, key_id = await p.tenancy.create_key("t1", "laptop")
    session = await p.tenancy.create_session("t1", [], {}, "", "", "", key_id=key_id)
    rid = await domain.ready_registration(session=session)
    named = await p.publish(tmp_path, rid, 1)
    path = await p.name(rid, 1, "step-1", named)
    pinned = await p.publish(tmp_path, rid, 2)
    await p.sampler(session, 0, rid, 2)
    bare = await p.publish(tmp_path, rid, 3)  # superseded with nothing holding it
    newest = await p.publish(tmp_path, rid, 4)

    assert await p.collector.collect_due() == 0  # within the grace
    assert await p.collect_after_grace() == 1
    assert await p.published(rid) == [1, 2, 4]
    assert bare.is_dir()  # its folder waits for the reclaimer's own grace
    domain.clock.now += GRACE
    assert await p.reclaimer.reclaim_due() == 1
    assert not bare.exists() and named.is_dir() and pinned.is_dir()

    # The sampler checkpoint deleted: its version goes; the run's newest never does.
    await p.catalog.delete("t1", path)
    assert await p.collect_after_grace() == 1
    assert await p.collect_after_grace() == 0
    assert await p.published(rid) == [2, 4]

    # The session finished and expired: its snapshot sampler goes, and the version with it.
    await p.tenancy.finish("t1", session, "closed by the client")
    domain.clock.now += 100
    assert await p.tenancy.expire_finished(100) == 1
    assert await p.collect_after_grace() == 1
    assert await p.published(rid) == [4]
    domain.clock.now += GRACE
    assert await p.reclaimer.reclaim_due() == 2
    assert sorted(x.name for x in (tmp_path / rid).iterdir()) == ["4"] and newest.is_dir()
    assert await p.catalog.repo.reclaiming() == []
    left = [k for k in await domain.client.keys("*") if b"adapter_refs" in k]
    assert left == []  # no holder sets left behind
    assert await domain.client.zcard(domain.store.keys.versions_unheld) == 0


async def test_a_version_held_again_in_its_grace_stays_and_a_collected_one_cannot_be_pinned(
    domain: Domain, tmp_path: Path
) -> None:
    """The collection checks again before it drops anything; a sampler for a version
    collected meanwhile is refused. A sampler made from a checkpoint takes a version of its
    own (not the run's newest), held for it from the step that records the version, however
    long the sampler takes to be recorded, and let go with its session if it never is."""
    p = Parts(domain)
    _, key_id = await p.tenancy.create_key("t1", "laptop")
    session = await p.tenancy.create_session("t1", [], {}, "", "", "", key_id=key_id)
    rid = await domain.ready_registration()
    await p.publish(tmp_path, rid, 1)
    await p.publish(tmp_path, rid, 2)  # version 1 is let go
    await p.sampler(session, 0, rid, 1)  # ... and held again within its grace
    await p.publish(tmp_path, rid, 3, sampler_id=f"{session}:sample:1")
    domain.clock.now += 10 * GRACE  # the sampler takes its time (a rollout restarting)
    assert await p.collector.collect_due() == 0
    await p.sampler(session, 1, rid, 3)
    await p.publish(tmp_path, rid, 4, sampler_id=f"{session}:sample:2")  # never recorded
    await p.publish(tmp_path, rid, 5)  # version 2 is let go
    assert await p.collect_after_grace() == 1
    assert await p.published(rid) == [1, 3, 4, 5]
    with pytest.raises(errors.NotFound, match="collected"):
        await p.sampler(session, 3, rid, 2)
    assert await p.samplers.repo.load(f"{session}:sample:3") is None
    with pytest.raises(errors.NotFound):  # the hold is not a sampler
        await p.samplers.get("t1", f"{session}:sample:2")

    await p.tenancy.finish("t1", session, "closed by the client")
    domain.clock.now += 100
    assert await p.tenancy.expire_finished(100) == 1
    assert await p.collect_after_grace() == 3
    assert await p.published(rid) == [5]
    assert await p.repo.live(str(AdapterId(rid, 5))) is not None
