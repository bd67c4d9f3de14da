"""The real service as a subprocess, over real gRPC: bind, train, dedup, save, SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import (
    child_env,
    fb_output,
    free_port,
    payload_bytes,
    service_process,
    stop_process,
    wait_serving,
)
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2, trainer_pb2_grpc
from lorafleet_trainer import convert


@pytest.fixture
def service(model_dir: Path, tmp_path: Path):
    port = free_port()
    env = child_env(
        LORAFLEET_TRAINER_PORT=str(port),
        LORAFLEET_TRAINER_MODEL_PATH=str(model_dir),
        LORAFLEET_TRAINER_NUM_SLOTS="2",
        LORAFLEET_TRAINER_MAX_RANK="8",
        LORAFLEET_TRAINER_STORAGE_ROOT=str(tmp_path / "states"),
        LORAFLEET_TRAINER_TORCH_THREADS="1",
        LORAFLEET_TRAINER_GRACE_SECONDS="2",
    )
    with service_process("lorafleet_trainer", port, env, tmp_path / "trainer.log") as proc:
        yield port, proc


def _datum(tokens: list[int], targets: list[int]) -> common_pb2.Datum:
    return common_pb2.Datum(
        tokens=tokens,
        loss_fn_inputs={
            "target_tokens": convert.tensor_to_proto(torch.tensor(targets, dtype=torch.int64)),
            "weights": convert.tensor_to_proto(torch.ones(len(targets))),
        },
    )


async def test_service_end_to_end(service, tmp_path: Path) -> None:
    port, proc = service
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await wait_serving(channel, "lorafleet.v1.TrainerService")
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        info = await stub.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest(), timeout=5)
        assert info.num_slots == 2 and "ppo" in info.loss_fns and info.vocab_size == 256
        cfg = common_pb2.LoraConfig(rank=4, seed=3, train_attn=True, train_mlp=True)
        bound = await stub.BindSlot(
            trainer_pb2.BindSlotRequest(slot=0, registration_id="reg-a", lora_config=cfg),
            timeout=30,
        )
        assert bound.slot.registration_id == "reg-a" and bound.slot.optim_steps == 0

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.BindSlot(
                trainer_pb2.BindSlotRequest(
                    slot=1,
                    registration_id="reg-b",
                    lora_config=common_pb2.LoraConfig(rank=64, train_attn=True),
                ),
                timeout=30,
            )
        exc = from_rpc_error(err.value)
        assert isinstance(exc, InvalidArgument) and exc.field == "lora_config.rank"

        fb = trainer_pb2.ForwardBackwardRequest(
            items=[
                trainer_pb2.ForwardBackwardItem(
                    operation_id="op-1",
                    slot=0,
                    registration_id="reg-a",
                    payload=payload_bytes(
                        common_pb2.ForwardBackwardInput(
                            data=[_datum([1, 2, 3, 4], [2, 3, 4, 5])], loss_fn="cross_entropy"
                        )
                    ),
                ),
                trainer_pb2.ForwardBackwardItem(
                    operation_id="op-bad",
                    slot=0,
                    registration_id="reg-a",
                    payload=payload_bytes(
                        common_pb2.ForwardBackwardInput(
                            data=[_datum([1, 999], [2, 3])], loss_fn="cross_entropy"
                        )
                    ),
                ),
                trainer_pb2.ForwardBackwardItem(  # an item must carry forward(_backward)
                    operation_id="op-control",
                    slot=0,
                    registration_id="reg-a",
                    payload=controller_pb2.OperationPayload(
                        save_state=controller_pb2.SaveStatePayload(name="x")
                    ).SerializeToString(),
                ),
            ]
        )
        first = await stub.ForwardBackward(fb, timeout=600)
        ok, bad, control = first.results
        assert control.error.field == "payload" and "save_state" in control.error.message
        output = fb_output(ok)
        assert output.metrics["loss:sum"] > 0 and ok.target_tokens == 4
        logprobs = convert.tensor_from_proto(output.outputs[0].outputs["logprobs"], "x")
        assert logprobs.shape == (4,) and bool((logprobs < 0).all())
        assert bad.error.field == "data[0].tokens[1]"  # validate_msgs names the id

        again = await stub.ForwardBackward(
            trainer_pb2.ForwardBackwardRequest(items=[fb.items[0]]), timeout=600
        )
        assert again.results[0].result == ok.result
        slots = await stub.ListSlots(trainer_pb2.ListSlotsRequest(), timeout=5)
        assert slots.slots[0].tokens_trained == 4  # the duplicate was not applied twice

        step = trainer_pb2.OptimStepRequest(
            operation_id="op-2",
            slot=0,
            registration_id="reg-a",
            adam_params=common_pb2.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-12),
        )
        out = await stub.OptimStep(step, timeout=120)
        assert out.output.applied and out.output.metrics["grad_norm"] > 0
        out2 = await stub.OptimStep(step, timeout=120)
        assert out2.output == out.output
        slots = await stub.ListSlots(trainer_pb2.ListSlotsRequest(), timeout=5)
        assert slots.slots[0].optim_steps == 1

        saved = await stub.SaveState(
            trainer_pb2.SaveStateRequest(
                operation_id="op-3",
                slot=0,
                registration_id="reg-a",
                name="step-1",
                include_optimizer=True,
            ),
            timeout=300,
        )
        assert saved.manifest.uri.startswith("file://") and len(saved.manifest.sha256) == 64
        assert (tmp_path / "states" / "reg-a" / "step-1" / "adapter_model.safetensors").is_file()

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.OptimStep(
                trainer_pb2.OptimStepRequest(
                    operation_id="op-4", slot=0, registration_id="reg-other"
                ),
                timeout=120,
            )
        assert isinstance(from_rpc_error(err.value), FailedPrecondition)

        chunks = [
            c
            async for c in stub.ExportAdapter(
                trainer_pb2.ExportAdapterRequest(slot=0, registration_id="reg-a"), timeout=120
            )
        ]
        assert {c.chunk.path for c in chunks} == {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
    t0 = time.monotonic()
    assert stop_process(proc, grace=60) == 0
    print(f"stopped in {time.monotonic() - t0:.1f}s")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"LORAFLEET_TRAINER_NUM_SLOTS": "many"}, "LORAFLEET_TRAINER_NUM_SLOTS"),
        ({"LORAFLEET_TRAINER_MODEL_PATH": "/nonexistent/model"}, "LORAFLEET_TRAINER_MODEL_PATH"),
    ],
)
def test_bad_settings_exit_2_with_one_line(model_dir: Path, env: dict, needle: str) -> None:
    full = child_env(**{"LORAFLEET_TRAINER_MODEL_PATH": str(model_dir), **env})
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_trainer"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
