"""Publish by reference on shared storage, with real controller, trainer and rollout processes.

The trainer writes the adapter into the shared root, the rollouts read and verify it
themselves: the controller moves no adapter bytes (no ExportAdapter stream, no chunks on
LoadAdapter; the rollouts' push counter says how each version came). What serves is exactly
what the streamed push of the same files serves, and an edited file is refused while the
serving version carries on.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from lorafleet import errors
from lorafleet.shared_storage import adapter_folder
from lorafleet.testing import child_env, free_port, op_result, start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2, rollout_pb2_grpc
from lorafleet_controller.clients import RolloutClient

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
SHARED = "LORAFLEET_{}_SHARED_ADAPTER_ROOT"


@pytest.fixture
async def shared_fleet(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[Fleet, list[Proc], Path]]:
    shared = tmp_path / "shared"
    redis = start_redis(tmp_path / "redis")
    controller = controller_proc(redis, tmp_path, **{SHARED.format("CONTROLLER"): str(shared)})
    procs: list[Proc] = []
    client = None
    try:
        controller.launch()
        trainer = trainer_proc(tiny_model_dir, controller.port, tmp_path, "trainer-0")
        trainer.env[SHARED.format("TRAINER")] = str(shared)
        rollouts = [
            rollout_proc(tiny_model_dir, controller.port, tmp_path, f"rollout-{i}")
            for i in range(2)
        ]
        for r in rollouts:
            r.env[SHARED.format("ROLLOUT")] = str(shared)
            r.env["LORAFLEET_ROLLOUT_METRICS_PORT"] = str(free_port())
        procs = [trainer, *rollouts]
        for p in procs:
            p.launch()
        controller.wait()
        for p in procs:
            p.wait()
        client = Client(controller.port)
        base = await wait_for_model(client)

        async def both_healthy() -> bool:
            status = await client("GetFleetStatus", K.GetFleetStatusRequest())
            healthy = {r.replica_id for r in status.replicas if r.healthy}  # type: ignore[attr-defined]
            return {"rollout-0", "rollout-1"} <= healthy

        await wait_until_async(both_healthy, "rollout-0 and rollout-1 registered and healthy")
        yield Fleet(Procs(tmp_path, redis, controller, trainer), client, base), rollouts, shared
    finally:
        if client is not None:
            await client.close()
        for p in procs:
            p.stop()
        controller.stop()
        redis.stop()


def pushes(rollout: Proc) -> dict[str, float]:
    """The rollout's lorafleet_rollout_adapter_pushes_total by `via`."""
    url = f"http://127.0.0.1:{rollout.env['LORAFLEET_ROLLOUT_METRICS_PORT']}/metrics"
    out = {"stream": 0.0, "shared": 0.0}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("lorafleet_rollout_adapter_pushes_total{"):
            via = line.split('via="', 1)[1].split('"', 1)[0]
            out[via] = float(line.rsplit(" ", 1)[1])
    return out


async def resident(rollout: Proc) -> list[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rollout.port}") as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        resp = await stub.ListAdapters(rollout_pb2.ListAdaptersRequest(), timeout=5)
        return sorted(a.adapter_id for a in resp.adapters)


async def greedy(rollout: Proc, ref: common_pb2.AdapterRef) -> common_pb2.SampleOutput:
    client = RolloutClient(f"127.0.0.1:{rollout.port}", retry_seconds=0)
    try:
        return await client.sample(
            rollout_pb2.SampleRequest(
                request_id="eq",
                adapter=ref,
                prompt_tokens=TOKENS[:5],
                num_samples=1,
                params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=1),
                prompt_logprobs=True,
            )
        )
    finally:
        await client.close()


async def test_publish_by_reference_moves_no_bytes_through_the_controller(
    shared_fleet: tuple[Fleet, list[Proc], Path],
) -> None:
    fleet, rollouts, shared = shared_fleet
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
    assert op_result(op).save_weights_for_sampler.version == 1

    # the run's home rollout read the version itself (the others load it on a first sample
    # there); the controller neither received nor wrote it
    holders = [r for r in rollouts if f"{rid}@1" in await resident(r)]
    assert len(holders) == 1
    (home,) = holders
    (other,) = [r for r in rollouts if r is not home]
    assert pushes(home) == {"stream": 0.0, "shared": 1.0}
    assert pushes(other) == {"stream": 0.0, "shared": 0.0}
    assert not (fleet.procs.root / "controller-storage" / "adapters").exists()
    folder = adapter_folder(shared.resolve(), rid, 1)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}

    # what serves is exactly what the streamed push of the same files serves
    reg = await fleet.client(
        "GetRegistration", K.GetRegistrationRequest(tenant=T, registration_id=rid)
    )
    lora = reg.registration.lora_config  # type: ignore[attr-defined]
    copy = common_pb2.AdapterRef(registration_id="streamed-copy", version=1)
    pusher = RolloutClient(f"127.0.0.1:{home.port}", retry_seconds=0)
    try:
        await pusher.load_adapter(copy, lora, files, tenant=T)
        by_ref = await greedy(home, common_pb2.AdapterRef(registration_id=rid, version=1))
        streamed = await greedy(home, copy)
        assert list(by_ref.sequences[0].tokens) == list(streamed.sequences[0].tokens)
        assert list(by_ref.sequences[0].logprobs) == list(streamed.sequences[0].logprobs)
        assert by_ref.prompt_logprobs[1:] == streamed.prompt_logprobs[1:]
        assert pushes(home) == {"stream": 1.0, "shared": 1.0}

        # an edited file is refused (digest mismatch) and nothing is installed
        refs = {name: blob_ref(folder / name) for name in files}
        tampered = adapter_folder(shared.resolve(), "tampered", 1)
        shutil.copytree(folder, tampered)
        weights = bytearray((tampered / "adapter_model.safetensors").read_bytes())
        weights[-1] ^= 0x01
        (tampered / "adapter_model.safetensors").write_bytes(bytes(weights))
        bad = {
            name: common_pb2.BlobRef(
                uri=(tampered / name).as_uri(), sha256=r.sha256, size_bytes=r.size_bytes
            )
            for name, r in refs.items()
        }
        v2 = common_pb2.AdapterRef(registration_id=rid, version=2)
        with pytest.raises(errors.InvalidArgument, match="SHA-256"):
            await pusher.load_shared_adapter(v2, lora, bad, tenant=T)
        # a reference outside the replica's shared root is refused too
        outside = dict(refs)
        elsewhere = fleet.procs.root / "elsewhere"
        shutil.copytree(folder, elsewhere)
        outside["adapter_config.json"] = common_pb2.BlobRef(
            uri=(elsewhere / "adapter_config.json").as_uri(),
            sha256=refs["adapter_config.json"].sha256,
            size_bytes=refs["adapter_config.json"].size_bytes,
        )
        with pytest.raises(errors.FailedPrecondition, match="shared adapter root"):
            await pusher.load_shared_adapter(v2, lora, outside, tenant=T)
        assert f"{rid}@2" not in await resident(home)
        again = await greedy(home, common_pb2.AdapterRef(registration_id=rid, version=1))
        assert list(again.sequences[0].tokens) == list(by_ref.sequences[0].tokens)
    finally:
        await pusher.close()

    # a sampler on a training checkpoint: written to the shared root once, read by reference
    save = await fleet.submit(rid, 4, K.OperationPayload(save_state=K.SaveStatePayload(name="s")))
    op = await wait_done(fleet.client, T, save.operation_id)  # type: ignore[attr-defined]
    assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    sampler = await fleet.client(
        "CreateSampler",
        K.CreateSamplerRequest(
            tenant=T,
            session_id=session,
            sampling_session_seq_id=1,
            model_path=op_result(op).save_state.path,
        ),  # type: ignore[attr-defined]
    )
    assert sampler.sampler.adapter.version == 2  # type: ignore[attr-defined]
    assert (adapter_folder(shared.resolve(), rid, 2) / "adapter_model.safetensors").is_file()
    assert f"{rid}@2" in await resident(home)
    assert pushes(home) == {"stream": 1.0, "shared": 2.0}
    assert pushes(other) == {"stream": 0.0, "shared": 0.0}

    # a restarted home is reconciled by reference as well
    home.kill()
    home.start()

    # The push counter moves when LoadAdapter returns, a moment after ListAdapters can show
    # the version (CI on a loaded machine read it in between): wait for both.
    async def reconciled() -> bool:
        return f"{rid}@1" in await resident(home) and pushes(home)["shared"] >= 1.0

    await wait_until_async(reconciled, "the restarted home serving the live version by reference")
    assert pushes(home)["stream"] == 0.0


def blob_ref(path: Path) -> common_pb2.BlobRef:
    data = path.read_bytes()
    return common_pb2.BlobRef(
        uri=path.as_uri(), sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)
    )


@pytest.mark.parametrize("service", ["controller", "trainer", "rollout"])
def test_a_relative_shared_root_fails_at_start_up(service: str, tmp_path: Path) -> None:
    prefix = f"LORAFLEET_{service.upper()}_"
    env = child_env(
        **{f"{prefix}SHARED_ADAPTER_ROOT": "relative/shared", f"{prefix}MODEL_PATH": str(tmp_path)}
    )
    out = subprocess.run(
        [sys.executable, "-m", f"lorafleet_{service}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"{prefix}SHARED_ADAPTER_ROOT=relative/shared: must be an absolute path" in out.stderr
