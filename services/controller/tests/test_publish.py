"""The publish barrier and sampling, with real trainer and rollout processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorafleet.testing import free_port, op_result, start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2, rollout_pb2_grpc

from .fleet import (
    Client,
    Proc,
    controller_proc,
    fb_payload,
    optim_payload,
    rollout_proc,
    trainer_proc,
    wait_done,
    wait_for_model,
)
from .test_integration import TOKENS, Fleet, Procs

K = controller_pb2
T = "tenant-a"


@pytest.fixture
async def fleet_with_rollouts(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[Fleet, list[Proc]]]:
    """A controller, a trainer and two rollouts; `request.param`: the rollouts' extra env."""
    rollout_env: dict[str, str] = getattr(request, "param", {})
    redis = start_redis(tmp_path / "redis")
    # rollout-0 registers itself; rollout-1 does not: the controller finds it in its static
    # replica list and probes it (GetRolloutInfo) every heartbeat interval.
    static_port = free_port()
    controller = controller_proc(
        redis,
        tmp_path,
        LORAFLEET_CONTROLLER_DISCOVERY="static",
        LORAFLEET_CONTROLLER_ROLLOUTS=f"rollout-1=127.0.0.1:{static_port}",
        LORAFLEET_CONTROLLER_HEARTBEAT_INTERVAL_SECONDS="0.5",
    )
    procs: list[Proc] = []
    client = None
    try:
        controller.launch()
        trainer = trainer_proc(tiny_model_dir, controller.port, tmp_path, "trainer-0")
        procs.append(trainer)
        rollouts = [
            rollout_proc(tiny_model_dir, controller.port, tmp_path, "rollout-0", **rollout_env),
            rollout_proc(
                tiny_model_dir,
                controller.port,
                tmp_path,
                "rollout-1",
                port=static_port,
                register=False,
                **rollout_env,
            ),
        ]
        procs += rollouts
        for p in procs:
            p.launch()
        controller.wait()
        for p in procs:
            p.wait()
        client = Client(controller.port)
        base = await wait_for_model(client)

        async def sampleable() -> Any:
            caps = await client("GetCapabilities", K.GetCapabilitiesRequest())
            return caps if all(m.sampleable for m in caps.models) else None  # type: ignore[attr-defined]

        caps = await wait_until_async(sampleable, "the base model sampleable")
        assert [(m.name, m.trainable, m.sampleable) for m in caps.models] == [(base, True, True)]

        async def both_rollouts() -> bool:  # the barrier must cover the static one too
            fleet_status = await client("GetFleetStatus", K.GetFleetStatusRequest())
            ids = {r.replica_id for r in fleet_status.replicas}  # type: ignore[attr-defined]
            return {"rollout-0", "rollout-1"} <= ids

        # a second rollout loading its model on a busy machine takes a while (issue 23)
        await wait_until_async(both_rollouts, "rollout-0 and rollout-1 registered")
        yield Fleet(Procs(tmp_path, redis, controller, trainer), client, base), rollouts
    finally:
        if client is not None:
            await client.close()
        for p in procs:
            p.stop()
        controller.stop()
        redis.stop()


async def resident(rollout: Proc) -> list[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rollout.port}") as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        resp = await stub.ListAdapters(rollout_pb2.ListAdaptersRequest(), timeout=5)
        return sorted(a.adapter_id for a in resp.adapters)


def greedy_sample(sampler_id: str, seq: int) -> K.SubmitSampleRequest:
    return K.SubmitSampleRequest(
        tenant=T,
        sampler_id=sampler_id,
        seq_id=seq,
        prompt_tokens=TOKENS[:4],
        params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=1),
        num_samples=1,
    )


@pytest.mark.parametrize(
    "fleet_with_rollouts", [{"LORAFLEET_ROLLOUT_MAX_STORED_ADAPTERS": "2"}], indirect=True
)
async def test_two_rollouts_hold_twice_the_adapters_of_one(
    fleet_with_rollouts: tuple[Fleet, list[Proc]],
) -> None:
    """Each rollout stores at most two versions; four runs' versions are all held, two on
    each (their homes), and sampling every one in turn moves none: one rollout alone would
    have to drop and reload two of them."""
    fleet, rollouts = fleet_with_rollouts
    samplers: dict[str, str] = {}
    for i in range(4):
        session = await fleet.session()
        rid = await fleet.registration(session, seed=30 + i)
        publish = await fleet.submit(
            rid,
            1,
            K.OperationPayload(
                save_weights_for_sampler=K.SaveWeightsForSamplerPayload(
                    sampler_session_id=f"{session}:sample:0", kind="snapshot"
                )
            ),
        )
        op = await wait_done(fleet.client, T, publish.operation_id)  # type: ignore[attr-defined]
        assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
        samplers[rid] = op_result(op).save_weights_for_sampler.sampler_id
    held = [await resident(r) for r in rollouts]
    assert [len(h) for h in held] == [2, 2], held
    assert sorted(held[0] + held[1]) == sorted(f"{rid}@1" for rid in samplers)
    tokens: dict[str, list[int]] = {}
    for round_ in range(2):
        for rid, sampler_id in samplers.items():
            sample = await fleet.client("SubmitSample", greedy_sample(sampler_id, round_))
            op = await wait_done(fleet.client, T, sample.operation_id)  # type: ignore[attr-defined]
            assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
            got = list(op_result(op).sample.sequences[0].tokens)
            assert tokens.setdefault(rid, got) == got
    assert [await resident(r) for r in rollouts] == held  # every sample ran at its home


async def test_publish_reaches_the_home_rollout_then_samples(
    fleet_with_rollouts: tuple[Fleet, list[Proc]],
) -> None:
    fleet, rollouts = fleet_with_rollouts
    session = await fleet.session()
    rid = await fleet.registration(session)
    await fleet.submit(rid, 1, fb_payload(TOKENS))
    await fleet.submit(rid, 2, optim_payload())
    publish = await fleet.submit(
        rid,
        3,
        K.OperationPayload(
            save_weights_for_sampler=K.SaveWeightsForSamplerPayload(
                name="step-1", sampler_session_id=f"{session}:sample:0", kind="snapshot"
            )
        ),
    )
    op = await wait_done(fleet.client, T, publish.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    result = op_result(op).save_weights_for_sampler
    assert result.version == 1 and result.path == f"tinker://{rid}/sampler_weights/step-1"
    # the barrier: the registration's home rollout had it before the op succeeded, and only
    # the home (capacity grows with rollouts: each holds its share)
    holding = [r for r in rollouts if f"{rid}@1" in await resident(r)]
    assert len(holding) == 1
    home = rollouts.index(holding[0])
    reg = await fleet.client(
        "GetRegistration", K.GetRegistrationRequest(tenant=T, registration_id=rid)
    )
    assert reg.registration.published_version == 1  # type: ignore[attr-defined]

    sample = await fleet.client(
        "SubmitSample",
        K.SubmitSampleRequest(
            tenant=T,
            sampler_id=result.sampler_id,
            seq_id=1,
            prompt_tokens=TOKENS[:4],
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=1),
            num_samples=2,
        ),
    )
    assert len(sample.sequence_ids) == 2  # type: ignore[attr-defined]
    op = await wait_done(fleet.client, T, sample.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    assert len(op_result(op).sample.sequences) == 2

    # the named sampler checkpoint is in the catalog and downloadable as PEFT files
    files: dict[str, bytes] = {}
    async for chunk in fleet.client.stub.DownloadCheckpoint(
        K.DownloadCheckpointRequest(tenant=T, tinker_path=result.path), timeout=30
    ):
        files[chunk.path] = files.get(chunk.path, b"") + chunk.data
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await fleet.client.stub.GetCheckpoint(
            K.GetCheckpointRequest(tenant="someone-else", tinker_path=result.path), timeout=5
        )
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND

    # a restarted home (new incarnation) is reconciled with the live version; rollout-1
    # never calls RegisterReplica, so only discovery's probe can notice its restart
    rollouts[home].kill()
    rollouts[home].start()

    async def reconciled() -> bool:
        return f"{rid}@1" in await resident(rollouts[home])

    await wait_until_async(reconciled, f"the restarted rollout-{home} serving the live version")

    # A publish while its home restarts at another address (a rescheduled pod: until its
    # heartbeat lapses the controller still counts the old address healthy) waits for it
    # (or, once the home is seen lost, publishes to another home) instead of failing, since
    # the SDK cannot retry a spent seq_id (CAMPAIGN_FAULTS=500 failed on 'Connection
    # refused'). rollout-1's address is static, so only rollout-0 can move.
    rollouts[0].kill()
    rollouts[0].port = free_port()
    rollouts[0].env["LORAFLEET_ROLLOUT_PORT"] = str(rollouts[0].port)
    publish = await fleet.submit(
        rid,
        4,
        K.OperationPayload(save_weights_for_sampler=K.SaveWeightsForSamplerPayload(name="step-2")),
    )
    rollouts[0].start()
    op = await wait_done(fleet.client, T, publish.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    assert op_result(op).save_weights_for_sampler.version == 2

    assert any([f"{rid}@2" in await resident(r) for r in rollouts])  # the home acked it

    # A replica that lost the version without the controller noticing (its reconcile still
    # running, or lost with the controller that ran it; found by CAMPAIGN_FAULTS=500): the
    # sample pinned to it gets the live version put back and is served, not failed.
    for rollout in rollouts:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rollout.port}") as ch:
            await rollout_pb2_grpc.RolloutServiceStub(ch).UnloadAdapter(
                rollout_pb2.UnloadAdapterRequest(
                    adapter=common_pb2.AdapterRef(registration_id=rid, version=1)
                ),
                timeout=10,
            )
        assert f"{rid}@1" not in await resident(rollout)
    sample = await fleet.client(
        "SubmitSample",
        K.SubmitSampleRequest(
            tenant=T,
            sampler_id=result.sampler_id,
            seq_id=2,
            prompt_tokens=TOKENS[:4],
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=1),
            num_samples=1,
        ),
    )
    op = await wait_done(fleet.client, T, sample.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    assert any([f"{rid}@1" in await resident(r) for r in rollouts])

    # No healthy rollout: a sample waits out their restart (the SDK cannot retry a failed
    # operation; found by CAMPAIGN_FAULTS=500), and fails at once only when every rollout
    # failed for good.
    def sample_request(seq: int) -> K.SubmitSampleRequest:
        return K.SubmitSampleRequest(
            tenant=T,
            sampler_id=result.sampler_id,
            seq_id=seq,
            prompt_tokens=TOKENS[:4],
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=1),
            num_samples=1,
        )

    async def rollouts_healthy() -> set[bool]:
        status = await fleet.client("GetFleetStatus", K.GetFleetStatusRequest())
        replicas = status.replicas  # type: ignore[attr-defined]
        return {r.healthy for r in replicas if r.replica_id.startswith("rollout")}

    for rollout in rollouts:
        rollout.kill()

    async def all_down() -> bool:
        return await rollouts_healthy() == {False}

    await wait_until_async(all_down, "both rollouts seen down (heartbeat timeout)")
    waiting = await fleet.client("SubmitSample", sample_request(3))
    for rollout in rollouts:
        rollout.launch()
    for rollout in rollouts:
        rollout.wait()
    op = await wait_done(fleet.client, T, waiting.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]

    for i, rollout in enumerate(rollouts):
        rollout.kill()
        await fleet.client(
            "ReportReplicaFailed",
            K.ReportReplicaFailedRequest(replica_id=f"rollout-{i}", reason="restart budget spent"),
        )
    failing = await fleet.client("SubmitSample", sample_request(4))
    op = await wait_done(fleet.client, T, failing.operation_id, within=10)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_FAILED  # type: ignore[attr-defined]
    assert "(failed: restart budget spent)" in op.error.message, op.error  # type: ignore[attr-defined]
