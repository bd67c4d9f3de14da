"""A publish never exports a slot in the middle of its run's restore (real Redis, a real
trainer process, a TCP relay of our own between the publisher and the trainer).

Found by the fault campaign (tests/e2e/test_campaign.py, CAMPAIGN_FAULTS=100): the sampling
tenant's save_weights_for_sampler was dispatched while its trainer was already dead, and the
export's transport retries reached the restarted trainer after the restore had bound the slot
afresh but before it loaded the snapshot and replayed: version 7 went live with the initial
weights (lora_B all zero) and version 24 with the weights of step 20, and because a version's
folder is written once, the publish re-run after the restore served those files. The run's
own state was right throughout (no other tenant's adapter was served): a stale version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors

from lorafleet import errors
from lorafleet.testing import RedisServer, free_port, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2
from lorafleet_controller.catalog import Catalog
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.ledger import Claim
from lorafleet_controller.publish import Publisher
from lorafleet_controller.registry import Replica
from lorafleet_controller.samplers import Samplers
from lorafleet_controller.store import RegState

from .conftest import Domain
from .fleet import Proc, fb_payload, optim_payload, rollout_proc, trainer_proc

K = controller_pb2
T = "tenant-p"
LORA = common_pb2.LoraConfig(rank=4, seed=5, train_attn=True)
WEIGHTS = "adapter_model.safetensors"


class HeldRelay:
    """Accepts connections at once but forwards nothing until `release`: a call sent now
    reaches the trainer only when the test says so."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.accepted = 0
        self.released = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await self.released.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pipes = [
            asyncio.create_task(_pipe(reader, up_writer)),
            asyncio.create_task(_pipe(up_reader, writer)),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@pytest.fixture(params=["streamed", "shared"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Path | None:
    """The adapter pushed through the controller, or written by the trainer on shared
    storage (lorafleet.shared_storage: the campaign's fleet)."""
    return tmp_path / "shared" if request.param == "shared" else None


@pytest.fixture
def trainer(tmp_path: Path, tiny_model_dir: Path, shared: Path | None) -> Iterator[Proc]:
    """A trainer on its own: nothing answers at its controller address, so only the test
    binds and trains its slots."""
    proc = trainer_proc(tiny_model_dir, free_port(), tmp_path, "trainer-0")
    if shared is not None:
        proc.env["LORAFLEET_TRAINER_SHARED_ADAPTER_ROOT"] = str(shared)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def rollout(tmp_path: Path, tiny_model_dir: Path, shared: Path | None) -> Iterator[Proc]:
    """A rollout on its own (the test records it in the registry), counting its pushes."""
    proc = rollout_proc(tiny_model_dir, free_port(), tmp_path, "rollout-0", register=False)
    proc.env["LORAFLEET_ROLLOUT_METRICS_PORT"] = str(free_port())
    if shared is not None:
        proc.env["LORAFLEET_ROLLOUT_SHARED_ADAPTER_ROOT"] = str(shared)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def pushes(rollout: Proc) -> float:
    """The rollout's lorafleet_rollout_adapter_pushes_total, over both ways."""
    url = f"http://127.0.0.1:{rollout.env['LORAFLEET_ROLLOUT_METRICS_PORT']}/metrics"
    lines = urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
    total = "lorafleet_rollout_adapter_pushes_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(total))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> tuple[str, bool]:
    """The domain on one redis-server only: the subject is the trainer side, not the store."""
    return redis_server.url, False


async def train(trainer: TrainerClient, rid: str, slot: int, tag: str) -> None:
    """Two optimizer steps on different data (`tag` keeps the operation ids apart)."""
    for step in range(2):
        tokens = [(7 * step + 5 * i) % 250 + 1 for i in range(8)]
        item = trainer_pb2.ForwardBackwardItem(
            operation_id=f"{rid}#{tag}{2 * step + 1}",
            slot=slot,
            registration_id=rid,
            payload=fb_payload(tokens).SerializeToString(deterministic=True),
        )
        resp = await trainer.forward_backward([item])
        assert resp.results[0].WhichOneof("outcome") == "result", resp.results[0]
        await trainer.optim_step(
            f"{rid}#{tag}{2 * step + 2}", slot, rid, optim_payload().optim_step
        )


async def exported(trainer: TrainerClient, rid: str, slot: int) -> dict[str, torch.Tensor]:
    return load_tensors((await trainer.export_adapter(slot, rid))[WEIGHTS])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


async def test_a_publish_retried_into_a_restore_exports_nothing_and_reruns_afterwards(
    domain: Domain, trainer: Proc, shared: Path | None, tmp_path: Path
) -> None:
    """The publish is dispatched while its run is READY; its export waits (the relay holds
    it, as a dead trainer held the campaign's) while the trainer is lost and the run's restore
    binds the slot afresh; the export then reaches that slot before the replay. It must not
    go live: it fails with a lease reason (the scheduler asks again once the run holds a
    slot) and writes no folder; re-run after the restore it publishes the trained weights."""
    relay = HeldRelay(trainer.port)
    await relay.start()
    direct = TrainerClient(f"127.0.0.1:{trainer.port}", retry_seconds=30)
    pool = Pool(retry_seconds=60, timeout=120)
    registry, clock = domain.registry, domain.clock
    try:
        info = await direct.info()
        base = info.base_model
        rep = Replica(
            "trainer",
            "trainer-0",
            f"127.0.0.1:{relay.port}",
            base,
            info.num_slots,
            "inc-1",
            clock(),
            True,
        )
        await registry.register_replica(rep)
        rec, _ = await registry.create(T, "s1", 0, base, LORA, {}, "adamw", False)
        rid = rec.registration_id
        placement = await registry.place(rid)
        assert placement.code == "placed"
        await direct.bind(placement.slot, rid, LORA)
        assert await registry.bound(rid, placement.replica, placement.slot)
        await train(direct, rid, placement.slot, "")
        trained = await exported(direct, rid, placement.slot)

        storage = shared or tmp_path / "storage"  # where a version's folder is written
        publisher = Publisher(
            domain.store,
            tmp_path / "storage",
            registry,
            Catalog(domain.store, clock),
            Samplers(domain.store, domain.ledger, registry, pool, domain.settings),
            pool,
            resident_versions=2,
            shared_root=shared,
            rollout_wait_seconds=domain.settings.rollout_wait_seconds,
        )
        claim = Claim(
            operation_id=f"{rid}#5",
            registration_id=rid,
            seq_id=5,
            kind=K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
            payload=b"",
            replica=placement.replica,
            slot=placement.slot,
            dirty=False,
            base_model=base,
            tenant=T,
            submitted_at=clock(),
            claim=1,
        )
        sw = K.SaveWeightsForSamplerPayload()
        publish = asyncio.create_task(publisher.publish(claim, sw))
        await wait_until_async(lambda: relay.accepted > 0, "the export reached the relay")

        # The trainer is lost and comes back; the restore binds the run's slot afresh ...
        clock.now += 5
        await registry.replica_lost("trainer-0", "trainer replica trainer-0 restarted")
        back = dataclasses.replace(rep, incarnation="inc-2", last_seen=clock())
        await registry.register_replica(back)
        again = await registry.place(rid)
        assert again.code == "placed" and (await registry.get_any(rid)).state == RegState.BINDING  # type: ignore[union-attr]
        await direct.unbind(again.slot, rid)
        await direct.bind(again.slot, rid, LORA)
        # ... and the held export arrives before the replay.
        relay.released.set()
        with pytest.raises(errors.FailedPrecondition) as refused:
            await publish
        assert refused.value.reason == "LEASE_MISMATCH"
        assert not list((storage / "adapters" / rid).glob("*"))  # nothing written or live
        assert not await domain.store.redis.zrange(domain.store.keys.live(base), 0, -1)

        # The replay ends the restore; the publish asked again exports the trained weights.
        await train(direct, rid, again.slot, "replay-")
        clock.now += 5
        assert await registry.bound(rid, again.replica, again.slot)
        claim = dataclasses.replace(claim, replica=again.replica, slot=again.slot)
        result, _ = await publisher.publish(claim, sw)
        version = result.save_weights_for_sampler.version
        folder = storage / "adapters" / rid / str(version)
        assert same(load_tensors((folder / WEIGHTS).read_bytes()), trained)
    finally:
        await relay.stop()
        await pool.close()
        await direct.close()


async def test_a_rerun_of_a_live_version_pushes_its_recorded_files(
    domain: Domain, trainer: Proc, rollout: Proc, shared: Path | None, tmp_path: Path
) -> None:
    """Regression (ac75fe9): an attempt made the version live and its controller died before
    the outcome; the re-dispatch must push the files recorded live, not export the slot
    again. Here the run trained on meanwhile, as a run replayed after a restore may differ in
    the last bits (a fresh export carries other files, which the rollout that loaded the
    version refuses), and the trainer is gone by the re-dispatch, as in the fault campaign
    (whose re-run then found the slot rebound and deleted the live folder). Before ac75fe9
    the re-run exported again and failed; now it pushes the recorded files, unchanged."""
    trainer_client = TrainerClient(f"127.0.0.1:{trainer.port}", retry_seconds=30)
    pool = Pool(retry_seconds=3, timeout=120)  # a dead trainer fails an export in seconds
    registry, clock = domain.registry, domain.clock
    try:
        info = await trainer_client.info()
        base = info.base_model
        address = f"127.0.0.1:{trainer.port}"
        rep = Replica("trainer", "trainer-0", address, base, info.num_slots, "i", clock(), True)
        await registry.register_replica(rep)
        await registry.register_replica(
            Replica("rollout", "rollout-0", f"127.0.0.1:{rollout.port}", base, 0, "r", 0, True)
        )
        rec, _ = await registry.create(T, "s1", 0, base, LORA, {}, "adamw", False)
        rid = rec.registration_id
        placement = await registry.place(rid)
        assert placement.code == "placed"
        await trainer_client.bind(placement.slot, rid, LORA)
        assert await registry.bound(rid, placement.replica, placement.slot)
        await train(trainer_client, rid, placement.slot, "")
        trained = await exported(trainer_client, rid, placement.slot)
        publisher = Publisher(
            domain.store,
            tmp_path / "storage",
            registry,
            Catalog(domain.store, clock),
            Samplers(domain.store, domain.ledger, registry, pool, domain.settings),
            pool,
            resident_versions=2,
            shared_root=shared,
            rollout_wait_seconds=domain.settings.rollout_wait_seconds,
        )
        claim = Claim(
            operation_id=f"{rid}#5",
            registration_id=rid,
            seq_id=5,
            kind=K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
            payload=b"",
            replica=placement.replica,
            slot=placement.slot,
            dirty=False,
            base_model=base,
            tenant=T,
            submitted_at=clock(),
            claim=1,
        )
        sw = K.SaveWeightsForSamplerPayload()
        first, _ = await publisher.publish(claim, sw)  # live; its outcome is never recorded
        version = first.save_weights_for_sampler.version
        folder = (shared or tmp_path / "storage") / "adapters" / rid / str(version)
        recorded = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert same(load_tensors(recorded[WEIGHTS]), trained)
        pushed = pushes(rollout)
        assert pushed == 1

        await train(trainer_client, rid, placement.slot, "more-")  # the slot moved on
        assert not same(await exported(trainer_client, rid, placement.slot), trained)
        trainer.stop()  # and the re-dispatch finds its trainer killed: it needs none
        again, _ = await publisher.publish(claim, sw)
        assert again.save_weights_for_sampler.version == version
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == recorded
        assert pushes(rollout) == pushed + 1  # pushed again: the recorded files, accepted
    finally:
        await pool.close()
        await trainer_client.close()
