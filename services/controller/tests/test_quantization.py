"""Every replica of a base model stores it the same way: a trainer and a rollout whose
quantization differs are refused at registration, and capabilities report the one in force.

A real controller process over gRPC; the replicas are records at addresses nothing answers
(registration does not dial them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.testing import RedisServer, free_port
from lorafleet.v1 import controller_pb2

from .fleet import Client, controller_proc

K = controller_pb2


@pytest.fixture
async def client(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[Client]:
    proc = controller_proc(redis_server, tmp_path)
    proc.start()
    c = Client(proc.port)
    try:
        yield c
    finally:
        await c.close()
        proc.stop()


async def _register(client: Client, kind: int, name: str, base: str, quantization: str) -> None:
    await client("RegisterReplica", K.RegisterReplicaRequest(
        kind=kind, replica_id=name, address=f"127.0.0.1:{free_port()}", base_model=base,
        num_slots=1, incarnation="a", max_rank=8, quantization=quantization,
    ))  # fmt: skip


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
