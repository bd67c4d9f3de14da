"""Exactly-once through trainer loss: a trainer SIGKILLed mid-run is replaced, and every run
it held is rebuilt from its last snapshot by replay, bit for bit; a run whose history is gone
fails loudly instead of rolling back (real redis, controller and trainer processes)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet.testing import start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2
from lorafleet_controller.controller import Controller
from lorafleet_controller.recovery import Corrupted, Recovery
from lorafleet_controller.registry import Replica
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import StaleEpoch, Store
from lorafleet_controller.store.keys import Keys

from .conftest import Clock
from .fleet import (
    Client,
    Proc,
    controller_proc,
    fb_payload,
    optim_payload,
    trainer_proc,
    trainer_stub,
    wait_done,
    wait_for_model,
)

K = controller_pb2
T = "tenant-r"
KEYS = Keys("lf:", 1)  # the controller's default prefix and groups
STEPS = 12  # forward_backward + optim_step each
SNAPSHOT_EVERY = 3  # optimizer steps


def tokens(step: int) -> list[int]:
    """Different data every step, so replaying out of order or twice would show."""
    return [(7 * step + 5 * i) % 250 + 1 for i in range(8)]


def step_ops(step: int) -> list[tuple[int, controller_pb2.OperationPayload]]:
    return [(2 * step + 1, fb_payload(tokens(step))), (2 * step + 2, optim_payload())]


@pytest.fixture
def procs(
    tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Path, object, Proc, Proc]]:
    """Redis, a controller and trainer-0; an indirect parameter adds controller settings."""
    redis = start_redis(tmp_path / "redis")
    controller = controller_proc(redis, tmp_path)
    controller.env["LORAFLEET_CONTROLLER_TRANSPORT_RETRY_SECONDS"] = "2"
    for name, value in getattr(request, "param", {}).items():
        controller.env[f"LORAFLEET_CONTROLLER_{name}"] = value
    trainer = trainer_proc(tiny_model_dir, controller.port, tmp_path, "trainer-0")
    trainer.env["LORAFLEET_TRAINER_SNAPSHOT_EVERY_STEPS"] = str(SNAPSHOT_EVERY)
    trainer.env["LORAFLEET_TRAINER_SNAPSHOT_EVERY_SECONDS"] = "0"
    try:
        controller.launch()
        trainer.launch()
        controller.wait()
        trainer.wait()
        yield tmp_path, redis, controller, trainer
    finally:
        trainer.stop()
        controller.stop()
        redis.stop()


class Run:
    """One training run driven through the controller's gRPC API."""

    def __init__(self, client: Client, rid: str) -> None:
        self.client, self.rid = client, rid

    async def submit(self, seq: int, payload: controller_pb2.OperationPayload) -> str:
        resp = await self.client(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant=T,
                registration_id=self.rid,
                seq_id=seq,
                payload=payload.SerializeToString(deterministic=True),
            ),
        )
        return resp.operation_id  # type: ignore[attr-defined]

    async def steps(self, steps: range) -> list[str]:
        """Submit the steps' operations (all at once: they queue behind each other)."""
        return [await self.submit(seq, p) for step in steps for seq, p in step_ops(step)]

    async def succeed(self, opids: list[str], within: float = 60) -> None:
        for opid in opids:
            op = await wait_done(self.client, T, opid, within=within)
            assert op.state == K.OPERATION_STATE_SUCCEEDED, (opid, op.error)  # type: ignore[attr-defined]


async def until(condition, what: str) -> None:
    """Wait for a condition (a callable returning a bool or an awaitable of one)."""
    await wait_until_async(condition, what)


async def slot_on(trainer: Proc, rid: str) -> int | None:
    """The trainer slot that holds the run now, if one does."""
    slots = await trainer_stub(trainer.port).ListSlots(trainer_pb2.ListSlotsRequest(), timeout=10)
    return next((s.slot for s in slots.slots if s.registration_id == rid), None)


async def export(trainer: Proc, rid: str) -> bytes:
    """The run's adapter weights file, straight from the trainer that holds it (waiting for
    it to hold it: a run the controller is still rebuilding after a restart has no slot)."""

    async def held() -> bool:
        return await slot_on(trainer, rid) is not None

    await until(held, f"{rid} held by the trainer")
    slot = await slot_on(trainer, rid)
    stub = trainer_stub(trainer.port)
    data = b""
    req = trainer_pb2.ExportAdapterRequest(slot=slot, registration_id=rid)
    async for part in stub.ExportAdapter(req, timeout=60):
        if part.chunk.path == "adapter_model.safetensors":
            data += part.chunk.data
    return data


async def test_trainer_sigkill_mid_run_is_replayed_bit_for_bit_or_fails_loudly(procs) -> None:
    _, redis_server, controller, trainer = procs
    client = Client(controller.port)
    r = aioredis.from_url(redis_server.url)  # type: ignore[attr-defined]
    try:
        base = await wait_for_model(client)
        session = (await client("CreateSession", K.CreateSessionRequest(tenant=T))).session_id  # type: ignore[attr-defined]

        async def run(seq: int, seed: int = 7) -> Run:
            resp = await client(
                "CreateRegistration",
                K.CreateRegistrationRequest(
                    tenant=T,
                    session_id=session,
                    model_seq_id=seq,
                    base_model=base,
                    lora_config=common_pb2.LoraConfig(
                        rank=4, seed=seed, dropout=0.1, train_attn=True, train_mlp=True
                    ),
                ),
            )
            return Run(client, resp.registration.registration_id)  # type: ignore[attr-defined]

        reference, lost_payload, lost_snapshot, victim = [await run(i) for i in range(4)]
        # The reference trains uninterrupted; its weights are what the victim must end with.
        await reference.succeed(await reference.steps(range(STEPS)))
        expected = await export(trainer, reference.rid)
        # Two runs whose history will be damaged while their trainer is down.
        await lost_payload.succeed(await lost_payload.steps(range(2)))  # no snapshot yet
        await lost_snapshot.succeed(await lost_snapshot.steps(range(SNAPSHOT_EVERY + 1)))
        seq = 2 * (SNAPSHOT_EVERY + 1)
        while not await r.hexists(KEYS.replay(lost_snapshot.rid), "snap"):
            seq += 1  # a step without gradients still reports the newest snapshot
            await lost_snapshot.succeed([await lost_snapshot.submit(seq, optim_payload())])

        # The victim's whole run is queued; the trainer dies with one of its steps in flight.
        ops = await victim.steps(range(STEPS))
        await victim.succeed(ops[:13])
        trainer.kill()
        # Contact is lost with an operation in flight: it is in doubt, never reported failed.
        await until(lambda: "in doubt" in controller.log.read_text(), "the op in doubt")
        await r.hdel(KEYS.replay(lost_payload.rid), "2")
        snap = trainer_pb2.SlotSnapshot.FromString(
            await r.hget(KEYS.replay(lost_snapshot.rid), "snap")
        )
        shutil.rmtree(unquote(urlparse(snap.manifest.uri).path))
        trainer.start()  # same replica id, new incarnation: it starts empty

        await victim.succeed(ops, within=180)  # every step exactly once: same weights
        assert await export(trainer, victim.rid) == expected
        assert await export(trainer, reference.rid) == expected  # rebuilt from its snapshot

        for broken, lost in (
            (lost_payload, "the payload of seq_id 2 is gone"),
            (lost_snapshot, "its last snapshot (seq_id"),
        ):
            key = KEYS.reg(broken.rid)
            await until(lambda key=key: r.hexists(key, "corrupted"), f"{key} corrupted")
            with pytest.raises(errors.FailedPrecondition) as refused:
                await broken.submit(100, fb_payload(tokens(0)))
            assert refused.value.reason == "RUN_CORRUPTED"
            assert lost in refused.value.message and broken.rid in refused.value.message
            reg = (
                await client(
                    "GetRegistration",
                    K.GetRegistrationRequest(tenant=T, registration_id=broken.rid),
                )
            ).registration  # type: ignore[attr-defined]
            assert reg.state == K.REGISTRATION_STATE_RETIRED and lost in reg.corrupted
    finally:
        await r.aclose()
        await client.close()


@pytest.mark.parametrize(
    "procs",
    [{"HEARTBEAT_INTERVAL_SECONDS": "1", "HEARTBEAT_TIMEOUT_SECONDS": "3"}],
    indirect=True,
)
async def test_a_redis_stall_longer_than_the_heartbeat_timeout_fails_nothing(procs) -> None:
    """Redis frozen (SIGSTOP) for twice the heartbeat timeout mid-run: no replica is declared
    lost for the silence Redis caused, no operation fails, and the weights are exact."""
    _, redis_server, controller, trainer = procs
    client = Client(controller.port)
    try:
        base = await wait_for_model(client)
        session = (await client("CreateSession", K.CreateSessionRequest(tenant=T))).session_id  # type: ignore[attr-defined]
        runs = []
        for seq in range(2):
            resp = await client(
                "CreateRegistration",
                K.CreateRegistrationRequest(
                    tenant=T,
                    session_id=session,
                    model_seq_id=seq,
                    base_model=base,
                    lora_config=common_pb2.LoraConfig(rank=4, seed=3, dropout=0.1, train_attn=True),
                ),
            )
            runs.append(Run(client, resp.registration.registration_id))  # type: ignore[attr-defined]
        reference, victim = runs
        await reference.succeed(await reference.steps(range(6)))
        expected = await export(trainer, reference.rid)
        ops = await victim.steps(range(6))
        await victim.succeed(ops[:5])
        redis_server.proc.send_signal(signal.SIGSTOP)  # type: ignore[attr-defined]
        try:
            await asyncio.sleep(6)  # the fault itself lasts this long; nothing waits on it
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
        await victim.succeed(ops, within=120)
        assert await export(trainer, victim.rid) == expected
        log = controller.log.read_text()
        assert "missed heartbeats" not in log and "restored" not in log
    finally:
        await client.close()


async def test_silence_while_redis_was_out_of_reach_is_not_a_lost_replica(redis_server) -> None:
    """Heartbeats go through Redis: a sweep that finds the previous good sweep longer ago than
    a heartbeat interval (Redis out of reach, or this process starved) judges silence afresh,
    and only a full heartbeat timeout of silence after that loses the replica."""
    clock = Clock()
    settings = ControllerSettings(
        redis_url=redis_server.url,
        heartbeat_interval_seconds=1,
        heartbeat_timeout_seconds=3,
        session_timeout_seconds=0,
    )
    controller = Controller(settings, clock=clock)
    await controller.start(lead=False)
    await controller.store.take_epoch()  # sweep by hand, without the sweeper loop
    try:
        rep = Replica("trainer", "tr-a", "127.0.0.1:1", "tiny", 2, "inc", 0, True)
        await controller.registry.register_replica(rep)
        clock.now += 10  # ten seconds without a heartbeat ...
        controller.sweeper._swept_at -= 10  # ... because the sweeper could not reach Redis either
        await controller.sweeper.sweep_once()
        assert (await controller.registry.replica("tr-a")).healthy  # type: ignore[union-attr]
        controller.sweeper._heard_since -= (
            settings.heartbeat_timeout_seconds
        )  # Redis back that long
        await controller.sweeper.sweep_once()
        assert not (await controller.registry.replica("tr-a")).healthy  # type: ignore[union-attr]
    finally:
        await controller.stop()


async def test_the_replay_log_keeps_what_a_snapshot_does_not_cover(domain) -> None:
    """The log itself (one redis-server and a Redis Cluster): only weight-changing kinds,
    each once, in seq_id order; a newer snapshot drops what it covers; a missing link, or a
    log gone although steps were applied, is corruption instead of a shorter history."""
    keys = domain.store.keys
    recovery = Recovery(domain.store, _no_manifest, _no_retire)
    rid = await domain.ready_registration()
    fb, opt = fb_payload(tokens(1)), optim_payload()
    forward = fb_payload(tokens(2), forward_only=True)
    kinds = {
        "fb": K.OPERATION_KIND_FORWARD_BACKWARD,
        "optim": K.OPERATION_KIND_OPTIM_STEP,
        "forward": K.OPERATION_KIND_FORWARD,
    }
    entries = [
        (rid, 1, kinds["fb"], fb),
        (rid, 2, kinds["optim"], opt),
        (rid, 3, kinds["forward"], forward),
        (rid, 4, kinds["fb"], fb),
    ]
    raw = [(r, s, k, p.SerializeToString()) for r, s, k, p in entries]
    await recovery.log(raw)
    await recovery.log(raw[1:2])  # a re-dispatched operation is logged once
    plan = await recovery.plan(rid)
    logged = {seq: body for _, seq, _, body in raw}  # replayed as logged: the bytes as they came
    assert plan.snapshot is None and plan.ops == [(s, logged[s]) for s in (1, 2, 4)]

    snapshot = trainer_pb2.SlotSnapshot(
        operation_id=f"{rid}#2", manifest=common_pb2.BlobRef(uri="file:///states/snap")
    )
    await recovery.record_snapshot(rid, snapshot)
    await recovery.record_snapshot(rid, trainer_pb2.SlotSnapshot(operation_id=f"{rid}#1"))
    await recovery.log(raw[1:2])  # covered by the snapshot: not kept again
    plan = await recovery.plan(rid)
    assert plan.snapshot == snapshot and plan.snapshot_seq == 2
    assert [s for s, _ in plan.ops] == [4]
    assert sorted(await domain.client.hkeys(keys.replay(rid))) == [b"4", b"snap", b"snap_seq"]

    await domain.client.hdel(keys.replay(rid), "4")  # a payload expired
    await recovery.log([(rid, 5, kinds["optim"], opt.SerializeToString())])
    with pytest.raises(Corrupted, match="the payload of seq_id 4 is gone"):
        await recovery.plan(rid)

    other = await domain.ready_registration(seq=1)
    await domain.client.hset(keys.reg(other), "optim_steps", 3)  # steps, but no log at all
    with pytest.raises(Corrupted, match="replay log is gone although 3 optimizer steps"):
        await recovery.plan(other)


async def _no_manifest(path: str) -> None:
    raise AssertionError(f"no checkpoint is loaded here ({path})")


async def _no_retire(rid: str, error: errors.LorafleetError) -> None:
    raise AssertionError(f"nothing is corrupted here ({rid}: {error})")


async def test_a_ready_id_lost_around_a_redis_outage_is_queued_again(redis_server) -> None:
    """A head popped from the ready list whose reply was lost (Redis frozen mid-reply) is
    queued again by the first sweep after the outage, so its run does not stall forever."""
    controller = Controller(
        ControllerSettings(redis_url=redis_server.url, session_timeout_seconds=0)
    )
    await controller.start(lead=False)
    await controller.store.take_epoch()  # sweep by hand, without the sweeper loop
    try:
        registry, keys, r = controller.registry, controller.store.keys, controller.store.redis
        await registry.register_replica(
            Replica("trainer", "tr-a", "127.0.0.1:1", "tiny", 2, "inc", 0, True)
        )
        rec, _ = await registry.create(
            "t1", "s1", 0, "tiny", common_pb2.LoraConfig(rank=4), {}, "adamw", False
        )
        placement = await registry.place(rec.registration_id)
        assert await registry.bound(rec.registration_id, placement.replica, placement.slot)
        adm = await controller.ledger.submit(
            "t1", rec.registration_id, 1, K.OPERATION_KIND_FORWARD_BACKWARD, b"", "d"
        )
        ready = keys.group(keys.group_of(rec.registration_id)).ready_data
        assert await r.lpop(ready) == adm.operation_id.encode()  # ... and lost
        await controller.sweeper.sweep_once()
        assert await r.lrange(ready, 0, -1) == []  # no outage: nothing to do
        controller.sweeper._swept_at -= 10  # the previous good sweep was long ago: Redis was away
        await controller.sweeper.sweep_once()
        assert await r.lrange(ready, 0, -1) == [adm.operation_id.encode()]
    finally:
        await controller.stop()


@pytest.mark.parametrize(
    "procs",
    [{"HEARTBEAT_INTERVAL_SECONDS": "1", "HEARTBEAT_TIMEOUT_SECONDS": "3"}],
    indirect=True,
)
async def test_batches_queued_behind_a_frozen_trainer_never_land_in_a_restore(procs) -> None:
    """The trainer frozen (SIGSTOP) past the heartbeat timeout while several runs' steps are
    queued for it: it is declared lost, its runs' operations are queued again, and when it
    comes back (same incarnation) its runs are restored on it. A batch that waited in the
    controller meanwhile must not be sent into a slot being restored (the fault campaign,
    tests/e2e/test_campaign.py, saw a load_state refused for un-stepped gradients and the run
    corrupted; Scheduler._run_batch now sends only claims still held): every run ends with
    the reference's weights, none corrupted."""
    _, redis_server, controller, trainer = procs
    client = Client(controller.port)
    r = aioredis.from_url(redis_server.url)  # type: ignore[attr-defined]
    try:
        base = await wait_for_model(client)
        session = (await client("CreateSession", K.CreateSessionRequest(tenant=T))).session_id  # type: ignore[attr-defined]
        runs = []
        for seq in range(5):
            resp = await client(
                "CreateRegistration",
                K.CreateRegistrationRequest(
                    tenant=T,
                    session_id=session,
                    model_seq_id=seq,
                    base_model=base,
                    lora_config=common_pb2.LoraConfig(rank=4, seed=5, train_attn=True),
                ),
            )
            runs.append(Run(client, resp.registration.registration_id))  # type: ignore[attr-defined]
        reference, *victims = runs
        await reference.succeed(await reference.steps(range(STEPS)))
        expected = await export(trainer, reference.rid)
        ops = [await v.steps(range(STEPS)) for v in victims]
        await victims[0].succeed(ops[0][:3])
        assert trainer.proc is not None
        trainer.proc.send_signal(signal.SIGSTOP)
        try:
            await until(lambda: "missed heartbeats" in controller.log.read_text(), "trainer lost")
            await asyncio.sleep(1)  # the backlog's batches stay queued behind the frozen one
        finally:
            trainer.proc.send_signal(signal.SIGCONT)
        for victim, theirs in zip(victims, ops, strict=True):
            await victim.succeed(theirs, within=180)
            assert await export(trainer, victim.rid) == expected
            assert not await r.hexists(KEYS.reg(victim.rid), "corrupted")
    finally:
        await r.aclose()
        await client.close()


async def test_a_deposed_leader_cannot_write_the_replay_log(domain) -> None:
    """Logging and snapshots are the leader's (store/recovery_log.py): once a newer leader
    took over, the deposed one's writes are refused and the log is what the new one wrote."""
    rid = await domain.ready_registration()
    old = Recovery(domain.store, _no_manifest, _no_retire)
    newer = Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups)
    await newer.take_epoch()
    new = Recovery(newer, _no_manifest, _no_retire)
    fb = fb_payload(tokens(1))
    applied = [(rid, 1, K.OPERATION_KIND_FORWARD_BACKWARD, fb.SerializeToString())]
    with pytest.raises(StaleEpoch):
        await old.log(applied)
    manifest = common_pb2.BlobRef(uri="file:///states/snap")
    with pytest.raises(StaleEpoch):
        await old.record_page(rid, 1, manifest)
    plan = await new.plan(rid)
    assert plan.snapshot is None and plan.ops == []
    await new.log(applied)
    assert (await new.plan(rid)).ops == [(1, fb.SerializeToString())]
    await new.record_page(rid, 1, manifest)
    assert await new.snapshot_uri(rid) == "file:///states/snap"


async def test_a_plan_read_while_operations_are_logged_is_whole(domain) -> None:
    """A restore reads its plan while the scheduler may still log (a late answer from a
    trainer the run has left): the log and the registration's newest seq_id are read in one
    step, so a plan never names an entry it does not hold (a run was corrupted for a
    payload that was there, under load)."""
    rid = await domain.ready_registration()
    recovery = Recovery(domain.store, _no_manifest, _no_retire)
    fb = fb_payload(tokens(1)).SerializeToString()
    for seq in range(1, 61):
        logged = recovery.log([(rid, seq, K.OPERATION_KIND_FORWARD_BACKWARD, fb)])
        _, plan = await asyncio.gather(logged, recovery.plan(rid))
        assert [s for s, _ in plan.ops] in (list(range(1, seq)), list(range(1, seq + 1)))
