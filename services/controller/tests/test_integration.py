"""The controller as a process, driving real trainer processes on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.testing import RedisServer, start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2

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
T = "tenant-a"


@dataclass
class Procs:
    """Redis, the controller and one trainer: started once per module and shared, since
    every test makes its own session and registrations (and deletes them afterwards)."""

    root: Path
    redis: RedisServer
    controller: Proc
    trainer: Proc


@dataclass
class Fleet:
    procs: Procs
    client: Client
    base_model: str
    rids: list[str] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.procs.root

    @property
    def redis(self) -> RedisServer:
        return self.procs.redis

    @redis.setter
    def redis(self, server: RedisServer) -> None:  # a test that restarts Redis hands it back
        self.procs.redis = server

    @property
    def controller(self) -> Proc:
        return self.procs.controller

    @property
    def trainer(self) -> Proc:
        return self.procs.trainer

    async def session(self) -> str:
        resp = await self.client("CreateSession", K.CreateSessionRequest(tenant=T))
        return resp.session_id  # type: ignore[attr-defined]

    async def registration(self, session: str, seq: int = 0, seed: int = 7) -> str:
        resp = await self.client(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant=T,
                session_id=session,
                model_seq_id=seq,
                base_model=self.base_model,
                lora_config=common_pb2.LoraConfig(
                    rank=4, seed=seed, train_attn=True, train_mlp=True
                ),
            ),
        )
        rid = resp.registration.registration_id  # type: ignore[attr-defined]
        self.rids.append(rid)
        return rid

    async def submit(self, rid: str, seq: int, payload: controller_pb2.OperationPayload):
        return await self.client(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant=T,
                registration_id=rid,
                seq_id=seq,
                payload=payload.SerializeToString(deterministic=True),
            ),
        )

    async def slot_of(self, rid: str) -> trainer_pb2.SlotInfo:
        resp = await trainer_stub(self.trainer.port).ListSlots(
            trainer_pb2.ListSlotsRequest(), timeout=5
        )
        return next(s for s in resp.slots if s.registration_id == rid)

    async def release(self) -> None:
        """Delete this test's registrations, so the next test finds every slot free."""
        for rid in self.rids:
            await self.client(
                "DeleteRegistration", K.DeleteRegistrationRequest(tenant=T, registration_id=rid)
            )


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Procs]:
    root = tmp_path_factory.mktemp("fleet")
    redis = start_redis(root / "redis", appendonly=True)
    controller = controller_proc(redis, root)
    trainer = trainer_proc(tiny_model_dir, controller.port, root, "trainer-0")
    shared = Procs(root, redis, controller, trainer)
    try:
        controller.launch()  # the trainer registers itself once the controller listens
        trainer.launch()
        controller.wait()
        trainer.wait()
        yield shared
    finally:
        trainer.stop()
        controller.stop()
        shared.redis.stop()


@pytest.fixture
async def fleet(procs: Procs) -> AsyncIterator[Fleet]:
    client = Client(procs.controller.port)
    fleet = Fleet(procs, client, "")
    try:
        fleet.base_model = await wait_for_model(client)
        yield fleet
    finally:
        try:
            await fleet.release()
        finally:
            await client.close()


TOKENS = [1, 5, 9, 13, 17, 21, 25, 29]


async def test_out_of_order_and_retried_ops_apply_once(fleet: Fleet) -> None:
    rid = await fleet.registration(await fleet.session())
    # chunks posted concurrently, the first one last (the SDK's parallel_fwdbwd_chunks)
    three, two = [await fleet.submit(rid, s, fb_payload(TOKENS)) for s in (3, 2)]
    subs = [await fleet.submit(rid, 1, fb_payload(TOKENS)), two, three]
    retry = await fleet.submit(rid, 1, fb_payload(TOKENS))
    assert retry.duplicate and retry.operation_id == subs[0].operation_id  # type: ignore[attr-defined]
    with pytest.raises(errors.Conflict):
        await fleet.submit(rid, 2, fb_payload(TOKENS[:4]))
    step = await fleet.submit(rid, 4, optim_payload())
    finished = []
    for sub in [*subs, step]:
        op = await wait_done(fleet.client, T, sub.operation_id)  # type: ignore[attr-defined]
        assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
        finished.append(op.finished_at)  # type: ignore[attr-defined]
    assert finished == sorted(finished)  # executed in seq order
    slot = await fleet.slot_of(rid)
    assert slot.tokens_trained == 3 * (len(TOKENS) - 1)  # every chunk applied exactly once
    assert slot.optim_steps == 1
    # billed from the target tokens the trainer reports with each result (the controller
    # does not parse the result it stores), once per operation
    usage = await fleet.client("GetUsage", K.GetUsageRequest(tenant=T))
    (billed,) = usage.tenants  # type: ignore[attr-defined]
    assert (billed.tokens_trained, billed.optim_steps) == (slot.tokens_trained, 1)
    reg = await fleet.client(
        "GetRegistration", K.GetRegistrationRequest(tenant=T, registration_id=rid)
    )
    assert reg.registration.optim_steps == 1  # type: ignore[attr-defined]


async def test_born_terminal_and_pending_gradient_guard(fleet: Fleet) -> None:
    rid = await fleet.registration(await fleet.session())
    bad = await fleet.submit(rid, 1, optim_payload(lr=-1.0))
    op = await wait_done(fleet.client, T, bad.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED  # type: ignore[attr-defined]
    assert op.error.field == "adam_params.learning_rate"  # type: ignore[attr-defined]
    fb = await fleet.submit(rid, 2, fb_payload(TOKENS))
    save = await fleet.submit(
        rid, 3, K.OperationPayload(save_state=K.SaveStatePayload(name="early"))
    )
    op = await wait_done(fleet.client, T, fb.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    op = await wait_done(fleet.client, T, save.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED  # type: ignore[attr-defined]
    assert op.error.reason == "GRADIENTS_PENDING", op.error  # type: ignore[attr-defined]


async def run_ops(fleet: Fleet, rid: str, n: int, kill_at: int | None = None) -> list[str]:
    """Submit n ops (fb, fb, optim, ...); SIGKILL and restart the controller at kill_at."""
    opids = []
    for seq in range(1, n + 1):
        payload = optim_payload() if seq % 3 == 0 else fb_payload([t + seq for t in TOKENS])
        if seq == kill_at:
            fleet.controller.kill()
            fleet.controller.start()
        while True:
            try:
                sub = await fleet.submit(rid, seq, payload)
                break
            except errors.Unavailable:
                await asyncio.sleep(0.1)
        opids.append(sub.operation_id)  # type: ignore[attr-defined]
    return opids


async def test_controller_sigkill_mid_run_executes_every_op_once(fleet: Fleet) -> None:
    session = await fleet.session()
    ref_rid = await fleet.registration(session, 0)
    rid = await fleet.registration(session, 1)
    # The reference finishes before the killed run starts, so every trainer batch of either
    # run holds just that run's one operation. Bit-identity is promised for identical
    # batches: a float32 GEMM's rounding can depend on how many rows share the call (MKL's
    # AVX2 kernels do), so two runs sharing batches may differ in the last bits.
    ref_ops = await run_ops(fleet, ref_rid, 50)
    for opid in ref_ops:
        op = await wait_done(fleet.client, T, opid, within=120)
        assert op.state == K.OPERATION_STATE_SUCCEEDED, (opid, op.error)  # type: ignore[attr-defined]
    ops = await run_ops(fleet, rid, 50, kill_at=20)
    for opid in ops:
        op = await wait_done(fleet.client, T, opid, within=120)
        assert op.state == K.OPERATION_STATE_SUCCEEDED, (opid, op.error)  # type: ignore[attr-defined]
    ref_slot, slot = await fleet.slot_of(ref_rid), await fleet.slot_of(rid)
    assert slot.tokens_trained == ref_slot.tokens_trained == 34 * (len(TOKENS) - 1)
    assert slot.optim_steps == ref_slot.optim_steps == 16
    stub = trainer_stub(fleet.trainer.port)

    async def export(r: str, s: int) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        req = trainer_pb2.ExportAdapterRequest(slot=s, registration_id=r)
        async for part in stub.ExportAdapter(req, timeout=60):
            files[part.chunk.path] = files.get(part.chunk.path, b"") + part.chunk.data
        return files

    ref_files, files = await export(ref_rid, ref_slot.slot), await export(rid, slot.slot)
    assert ref_files.keys() == files.keys()
    assert ref_files["adapter_model.safetensors"] == files["adapter_model.safetensors"]


async def test_redis_restart_with_aof_loses_no_admitted_op(fleet: Fleet) -> None:
    rid = await fleet.registration(await fleet.session())
    first = [await fleet.submit(rid, s, fb_payload(TOKENS)) for s in (1, 2)]
    port, data_dir = fleet.redis.port, fleet.redis.data_dir
    fleet.redis.proc.kill()
    fleet.redis.proc.wait(10)
    fleet.redis = start_redis(data_dir, port=port, appendonly=True)

    async def submitted() -> object:
        try:
            return await fleet.submit(rid, 3, optim_payload())
        except (errors.Unavailable, errors.Internal):  # Redis still loading its AOF
            return None

    later = await wait_until_async(submitted, "a submit after Redis restarted")
    for sub in [*first, later]:
        op = await wait_done(fleet.client, T, sub.operation_id)  # type: ignore[attr-defined]
        assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    assert (await fleet.slot_of(rid)).tokens_trained == 2 * (len(TOKENS) - 1)


async def test_delete_fences_and_frees_the_slot_for_the_queue(fleet: Fleet) -> None:
    session = await fleet.session()
    rids = [await fleet.registration(session, i) for i in range(5)]  # the trainer has 4 slots
    get = K.GetRegistrationRequest(tenant=T, registration_id=rids[4])
    queued = (await fleet.client("GetRegistration", get)).registration  # type: ignore[attr-defined]
    assert queued.state == K.REGISTRATION_STATE_QUEUED and queued.queue_position == 1
    waiting = await fleet.submit(rids[4], 1, fb_payload(TOKENS))
    blocked = await fleet.submit(rids[0], 2, fb_payload(TOKENS))  # behind a missing seq 1
    await fleet.client(
        "DeleteRegistration", K.DeleteRegistrationRequest(tenant=T, registration_id=rids[0])
    )
    op = await wait_done(fleet.client, T, blocked.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED and op.error.reason == "RETIRED"  # type: ignore[attr-defined]
    with pytest.raises(errors.FailedPrecondition):
        await fleet.submit(rids[0], 3, fb_payload(TOKENS))
    op = await wait_done(fleet.client, T, waiting.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED  # type: ignore[attr-defined]
    resp = await trainer_stub(fleet.trainer.port).ListSlots(
        trainer_pb2.ListSlotsRequest(), timeout=5
    )
    bound = {s.registration_id for s in resp.slots if s.registration_id}
    assert bound == set(rids[1:])


async def test_finishing_a_session_frees_its_slots_for_the_queue(fleet: Fleet) -> None:
    ours = await fleet.session()
    rids = [await fleet.registration(ours, i) for i in range(4)]  # every slot of the trainer
    other = await fleet.session()
    waiting_rid = await fleet.registration(other, 0)
    get = K.GetRegistrationRequest(tenant=T, registration_id=waiting_rid)
    queued = (await fleet.client("GetRegistration", get)).registration  # type: ignore[attr-defined]
    assert queued.state == K.REGISTRATION_STATE_QUEUED
    pending = await fleet.submit(rids[0], 2, fb_payload(TOKENS))  # blocked behind seq 1
    waiting = await fleet.submit(waiting_rid, 1, fb_payload(TOKENS))

    await fleet.client("FinishSession", K.FinishSessionRequest(tenant=T, session_id=ours))
    op = await wait_done(fleet.client, T, pending.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED  # type: ignore[attr-defined]
    assert op.error.reason == "SESSION_FINISHED"  # type: ignore[attr-defined]
    op = await wait_done(fleet.client, T, waiting.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED  # type: ignore[attr-defined]
    resp = await trainer_stub(fleet.trainer.port).ListSlots(
        trainer_pb2.ListSlotsRequest(), timeout=5
    )
    assert {s.registration_id for s in resp.slots if s.registration_id} == {waiting_rid}


async def test_a_run_its_trainer_refuses_fails_and_frees_its_slot(fleet: Fleet) -> None:
    """A bind the trainer refuses for the run's own config fails the run at once (RUN_FAILED)
    and gives its slot to the next run, instead of retrying for ever while holding it (issue
    26); the fleet status lists it as failed, with the trainer's reason."""
    sid = await fleet.session()
    for seq in range(3):  # 3 of the trainer's 4 slots
        await fleet.registration(sid, seq)
    bad = f"{sid}:train:3"
    fleet.rids.append(bad)
    with pytest.raises(errors.InvalidArgument) as refused:
        await fleet.client(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant=T,
                session_id=sid,
                model_seq_id=3,
                base_model=fleet.base_model,
                lora_config=common_pb2.LoraConfig(rank=4, target_modules=["zz_proj"]),
            ),
        )
    assert refused.value.reason == "RUN_FAILED" and "zz_proj" in str(refused.value)
    rid = await fleet.registration(sid, 4)  # the last slot is free again: it binds at once
    status = await fleet.client("GetFleetStatus", K.GetFleetStatusRequest())
    held = {reg.registration_id for rep in status.replicas for reg in rep.slots}  # type: ignore[attr-defined]
    assert rid in held and bad not in held
    failed = {reg.registration_id: reg for reg in status.attention}  # type: ignore[attr-defined]
    assert failed[bad].state == K.REGISTRATION_STATE_RETIRED and "zz_proj" in failed[bad].failed
