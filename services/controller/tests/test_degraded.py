"""A trainer that stays down (its supervisor spent the restart budget) strands nothing
silently: the runs waiting for it fail their open operations with Unavailable naming it (a
paged run whose call comes later too, by the next sweep), and GetFleetStatus shows the reason
in the replica table and the runs with theirs.

A real controller process over gRPC; the trainer is only a replica record at an address
nothing answers, so its one slot is taken by a run that never binds and the next run
waits, as behind a trainer that died."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet.testing import RedisServer, free_port, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import RegState, Store

from .fleet import Client, controller_proc, fb_payload

K = controller_pb2
REASON = "trainer-x exited with -9 after 5 restarts in 600s; it stays down"


@pytest.fixture
async def client(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[Client]:
    proc = controller_proc(redis_server, tmp_path)
    proc.env["LORAFLEET_CONTROLLER_TRANSPORT_RETRY_SECONDS"] = "0.3"  # binds fail fast here
    proc.start()
    c = Client(proc.port)
    try:
        yield c
    finally:
        await c.close()
        proc.stop()


async def _register(client: Client, incarnation: str) -> None:
    await client(
        "RegisterReplica",
        K.RegisterReplicaRequest(
            kind=K.REPLICA_KIND_TRAINER,
            replica_id="trainer-x",
            address=f"127.0.0.1:{free_port()}",
            base_model="m",
            num_slots=1,
            incarnation=incarnation,
            max_rank=8,
        ),
    )


async def test_a_failed_trainer_fails_the_calls_waiting_for_it(
    client: Client, redis_server: RedisServer
) -> None:
    await _register(client, "a")
    sid = (await client("CreateSession", K.CreateSessionRequest(tenant="t"))).session_id  # type: ignore[attr-defined]
    runs = []
    for seq in range(2):  # the first takes the slot (its bind is retried), the second waits
        reg = await client(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant="t",
                session_id=sid,
                model_seq_id=seq,
                base_model="m",
                lora_config=common_pb2.LoraConfig(rank=4),
            ),
        )
        runs.append(reg.registration.registration_id)  # type: ignore[attr-defined]
    status = await client("GetFleetStatus", K.GetFleetStatusRequest())
    assert [r.registration_id for r in status.queued_registrations] == [runs[1]]  # type: ignore[attr-defined]
    assert status.attention_total == 0  # type: ignore[attr-defined]
    submitted = await client(
        "SubmitOperation",
        K.SubmitOperationRequest(
            tenant="t",
            registration_id=runs[1],
            seq_id=1,
            payload=fb_payload([1, 2, 3]).SerializeToString(deterministic=True),
        ),
    )
    opid = submitted.operation_id  # type: ignore[attr-defined]
    op = (
        await client("GetOperation", K.GetOperationRequest(tenant="t", operation_id=opid))
    ).operation  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_QUEUED and op.waiting_for == K.WAITING_FOR_SLOT

    # The supervisor gives up on the trainer: the waiting call ends with Unavailable naming it.
    report = K.ReportReplicaFailedRequest(replica_id="trainer-x", reason=REASON)
    reply = await client("ReportReplicaFailed", report)
    assert sorted(reply.stranded) == sorted(runs)  # type: ignore[attr-defined]
    request = K.GetOperationRequest(tenant="t", operation_id=opid, wait_seconds=5)
    op = (await client("GetOperation", request)).operation  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED, op
    assert op.error.category == common_pb2.ERROR_CATEGORY_SERVER
    assert "no healthy trainer serves base model 'm'" in op.error.message
    assert f"trainer-x (failed: {REASON})" in op.error.message
    # Later calls on the run, and new runs, are refused with the same reason at once.
    with pytest.raises(errors.Unavailable, match="trainer-x"):
        await client(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant="t",
                registration_id=runs[1],
                seq_id=2,
                payload=fb_payload([1, 2, 3]).SerializeToString(deterministic=True),
            ),
        )
    with pytest.raises(errors.Unavailable, match=f"trainer-x \\(failed: {REASON}"):
        await client(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant="t",
                session_id=sid,
                model_seq_id=2,
                base_model="m",
                lora_config=common_pb2.LoraConfig(rank=4),
            ),
        )

    status = await client("GetFleetStatus", K.GetFleetStatusRequest())
    (replica,) = status.replicas  # type: ignore[attr-defined]
    assert not replica.healthy and replica.failed == REASON
    assert status.attention_total == 2  # type: ignore[attr-defined]
    for reg in status.attention:  # type: ignore[attr-defined]
        assert reg.state == K.REGISTRATION_STATE_UNAVAILABLE
        assert "trainer-x" in reg.unavailable_reason and REASON in reg.unavailable_reason

    # A paged run whose next call comes after the failure (made here by hand: paging needs a
    # trainer) queues for a slot, and the sweep fails that call too.
    redis = aioredis.from_url(redis_server.url)
    keys = Store(redis, ControllerSettings().key_prefix, 1).keys
    async with redis.pipeline(transaction=True) as pipe:  # one step: the sweep runs meanwhile
        pipe.hset(keys.reg(runs[1]), "state", RegState.PAGED.value)
        pipe.zrem(keys.regq("m"), runs[1])
        await pipe.execute()
    await redis.aclose()
    submitted = await client(
        "SubmitOperation",
        K.SubmitOperationRequest(
            tenant="t",
            registration_id=runs[1],
            seq_id=2,
            payload=fb_payload([1, 2, 3]).SerializeToString(deterministic=True),
        ),
    )
    opid = submitted.operation_id  # type: ignore[attr-defined]
    request = K.GetOperationRequest(tenant="t", operation_id=opid, wait_seconds=5)
    op = (await client("GetOperation", request)).operation  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED and "trainer-x (failed:" in op.error.message, op

    # It comes back (a person restarted it): the reason is gone and the runs are placed again.
    await _register(client, "b")

    async def back() -> bool:
        status = await client("GetFleetStatus", K.GetFleetStatusRequest())
        (replica,) = status.replicas  # type: ignore[attr-defined]
        return replica.healthy and not replica.failed and len(replica.slots) == 1

    await wait_until_async(back, "trainer-x healthy again, holding a run")
