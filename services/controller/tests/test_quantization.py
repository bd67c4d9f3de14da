"""Every replica of a base model stores it the same way: a trainer and a rollout whose
quantization differs are refused at registration, and capabilities report the one in force.

A real controller process over gRPC; the replicas are records at addresses nothing answers
(registration does not dial them)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.replica import Registrar, ReplicaSettings
from lorafleet.testing import RedisServer, free_port, wait_until_async
from lorafleet.v1 import controller_pb2

from .fleet import Client, Proc, controller_proc

K = controller_pb2


@pytest.fixture
def controller(redis_server: RedisServer, tmp_path: Path) -> Iterator[Proc]:
    proc = controller_proc(redis_server, tmp_path)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def client(controller: Proc) -> AsyncIterator[Client]:
    c = Client(controller.port)
    try:
        yield c
    finally:
        await c.close()


async def _register(client: Client, kind: int, name: str, base: str, quantization: str) -> None:
    await client(
        "RegisterReplica",
        K.RegisterReplicaRequest(
            kind=kind,
            replica_id=name,
            address=f"127.0.0.1:{free_port()}",
            base_model=base,
            num_slots=1,
            incarnation="a",
            max_rank=8,
            quantization=quantization,
        ),
    )


async def _quantization(client: Client) -> dict[str, str]:
    caps = await client("GetCapabilities", K.GetCapabilitiesRequest())
    return {m.name: m.quantization for m in caps.models}  # type: ignore[attr-defined]


async def test_a_replica_whose_quantization_differs_is_refused(client: Client) -> None:
    await _register(client, K.REPLICA_KIND_TRAINER, "trainer-0", "m", "int8")
    with pytest.raises(errors.FailedPrecondition) as refused:
        await _register(client, K.REPLICA_KIND_ROLLOUT, "rollout-0", "m", "none")
    assert refused.value.reason == "QUANTIZATION_MISMATCH"
    assert "trainer-0" in refused.value.message and "'int8'" in refused.value.message
    with pytest.raises(errors.FailedPrecondition):  # empty reads as "none"
        await _register(client, K.REPLICA_KIND_ROLLOUT, "rollout-0", "m", "")
    with pytest.raises(errors.FailedPrecondition):  # a second trainer too
        await _register(client, K.REPLICA_KIND_TRAINER, "trainer-1", "m", "fp8")
    status = await client("GetFleetStatus", K.GetFleetStatusRequest())
    assert [r.replica_id for r in status.replicas] == ["trainer-0"]  # type: ignore[attr-defined]

    await _register(client, K.REPLICA_KIND_ROLLOUT, "rollout-0", "m", "int8")
    await _register(client, K.REPLICA_KIND_TRAINER, "trainer-0", "m", "int8")  # heartbeat
    # Another base model is another matter.
    await _register(client, K.REPLICA_KIND_ROLLOUT, "rollout-9", "other", "")
    assert await _quantization(client) == {"m": "int8", "other": "none"}


async def test_an_unknown_quantization_is_invalid(client: Client) -> None:
    with pytest.raises(errors.InvalidArgument) as bad:
        await _register(client, K.REPLICA_KIND_TRAINER, "trainer-0", "m", "int4")
    assert bad.value.field == "quantization"


async def test_a_refused_replica_logs_why_and_keeps_trying(
    controller: Proc, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica's heartbeat is its registration: refused, it logs the controller's reason
    (not just "cannot register") and keeps retrying, never recorded meanwhile."""
    await _register(client, K.REPLICA_KIND_TRAINER, "trainer-0", "m", "int8")
    request = K.RegisterReplicaRequest(
        kind=K.REPLICA_KIND_ROLLOUT,
        replica_id="rollout-0",
        address=f"127.0.0.1:{free_port()}",
        base_model="m",
        incarnation="a",
        quantization="none",
    )
    settings = ReplicaSettings(
        controller_address=f"127.0.0.1:{controller.port}", register_interval_seconds=0.5
    )
    registrar = Registrar(settings, lambda: request)
    with caplog.at_level(logging.WARNING, logger="lorafleet.replica"):
        registrar.start()
        try:
            await wait_until_async(
                lambda: "serves it with 'int8'" in caplog.text, "the refusal in the log"
            )
            status = await client("GetFleetStatus", K.GetFleetStatusRequest())
            assert [r.replica_id for r in status.replicas] == ["trainer-0"]  # type: ignore[attr-defined]
        finally:
            await registrar.stop()
    assert "rollout-0" in caplog.text
