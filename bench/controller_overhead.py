"""End-to-end overhead of the controller: the trainer benchmark's loop sent through the
controller instead of straight to the trainer. Target ratio (controller / direct) >= 0.9.

    .venv/bin/python bench/controller_overhead.py [--steps 6] [--warmup 2]

One step = forward_backward (cross_entropy, batch 8 x 128) + optim_step on the ~20M "bench"
model with rank-8 LoRA on attention and MLP, as in bench/trainer_step.py. One trainer
process serves both loops from two slots: a controller process (on a private redis-server,
default settings) owns one slot through a registration; the direct loop binds the other slot
itself. The controller loop does what the SDK does: submit forward_backward and optim_step
(SubmitOperation) before awaiting either, long-poll both (GetOperation), acknowledge them.
The loops alternate step by step so machine noise hits both alike. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from trainer_step import BATCH, RANK, SEQ, bench_model_dir, make_batch

from lorafleet.rpc.channel import make_channel
from lorafleet.testing import (
    child_env,
    free_port,
    payload_bytes,
    service_process,
    start_redis,
    wait_serving,
)
from lorafleet.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from lorafleet_trainer.convert import tensor_to_proto

K = controller_pb2
TENANT = "bench"
LORA = common_pb2.LoraConfig(rank=RANK, alpha=32, train_attn=True, train_mlp=True)
ADAM = common_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)


def fb_input(ids: torch.Tensor, targets: torch.Tensor) -> common_pb2.ForwardBackwardInput:
    data = [
        common_pb2.Datum(
            tokens=ids[i].tolist(),
            loss_fn_inputs={
                "target_tokens": tensor_to_proto(targets[i]),
                "weights": tensor_to_proto(torch.ones(SEQ)),
            },
        )
        for i in range(BATCH)
    ]
    return common_pb2.ForwardBackwardInput(data=data, loss_fn="cross_entropy")


class Direct:
    """The trainer_step loop: ForwardBackward then OptimStep on the trainer's own gRPC."""

    def __init__(self, channel: object, slot: int) -> None:
        self.stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        self.slot, self.n = slot, 0

    async def bind(self) -> None:
        req = trainer_pb2.BindSlotRequest(
            slot=self.slot, registration_id="direct", lora_config=LORA
        )
        await self.stub.BindSlot(req, timeout=60)

    async def step(self, fb: common_pb2.ForwardBackwardInput) -> None:
        self.n += 1
        item = trainer_pb2.ForwardBackwardItem(
            operation_id=f"fb-{self.n}",
            slot=self.slot,
            registration_id="direct",
            payload=payload_bytes(fb),
        )
        resp = await self.stub.ForwardBackward(
            trainer_pb2.ForwardBackwardRequest(items=[item]), timeout=600
        )
        assert resp.results[0].WhichOneof("outcome") == "result", resp.results[0].error
        await self.stub.OptimStep(
            trainer_pb2.OptimStepRequest(
                operation_id=f"step-{self.n}",
                slot=self.slot,
                registration_id="direct",
                adam_params=ADAM,
            ),
            timeout=600,
        )


class ThroughController:
    """The same step as two ledger operations, pipelined like the SDK."""

    def __init__(self, channel: object) -> None:
        self.stub = controller_pb2_grpc.ControllerServiceStub(channel)
        self.seq = 0
        self.rid = ""

    async def register(self) -> int:
        """A READY registration on the trainer; returns the slot the controller chose."""
        base = ""
        for _ in range(1200):  # the trainer registers itself once its model is loaded
            caps = await self.stub.GetCapabilities(K.GetCapabilitiesRequest(), timeout=10)
            base = next((m.name for m in caps.models if m.trainable), "")
            if base:
                break
            await asyncio.sleep(0.1)
        session = await self.stub.CreateSession(K.CreateSessionRequest(tenant=TENANT), timeout=10)
        resp = await self.stub.CreateRegistration(
            K.CreateRegistrationRequest(
                tenant=TENANT, session_id=session.session_id, base_model=base, lora_config=LORA
            ),
            timeout=60,
        )
        self.rid = resp.registration.registration_id
        for _ in range(1200):
            reg = await self.stub.GetRegistration(
                K.GetRegistrationRequest(tenant=TENANT, registration_id=self.rid), timeout=10
            )
            if reg.registration.state == K.REGISTRATION_STATE_READY:
                return reg.registration.slot
            await asyncio.sleep(0.1)
        raise RuntimeError(f"registration {self.rid} never became READY")

    async def _submit(self, payload: K.OperationPayload) -> str:
        self.seq += 1
        resp = await self.stub.SubmitOperation(
            K.SubmitOperationRequest(
                tenant=TENANT,
                registration_id=self.rid,
                seq_id=self.seq,
                payload=payload.SerializeToString(deterministic=True),
            ),
            timeout=60,
        )
        return resp.operation_id

    async def _result(self, opid: str) -> None:
        while True:
            resp = await self.stub.GetOperation(
                K.GetOperationRequest(tenant=TENANT, operation_id=opid, wait_seconds=30),
                timeout=60,
            )
            op = resp.operation
            if op.state not in (K.OPERATION_STATE_QUEUED, K.OPERATION_STATE_CLAIMED):
                assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error
                await self.stub.AckOperation(
                    K.AckOperationRequest(tenant=TENANT, operation_id=opid), timeout=10
                )
                return

    async def step(self, fb: common_pb2.ForwardBackwardInput) -> None:
        fb_id = await self._submit(K.OperationPayload(forward_backward=fb))
        step_id = await self._submit(K.OperationPayload(optim_step=ADAM))
        await asyncio.gather(self._result(fb_id), self._result(step_id))


async def main(steps: int, warmup: int) -> dict[str, object]:
    model_dir, model_name = bench_model_dir()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis = start_redis(root / "redis")
        ctl_port, tr_port = free_port(), free_port()
        ctl_env = child_env(
            LORAFLEET_CONTROLLER_REDIS_URL=redis.url,
            LORAFLEET_CONTROLLER_PORT=str(ctl_port),
            LORAFLEET_CONTROLLER_STORAGE_ROOT=str(root / "controller"),
            LORAFLEET_CONTROLLER_LOG_LEVEL="WARNING",
        )
        tr_env = child_env(
            LORAFLEET_TRAINER_PORT=str(tr_port),
            LORAFLEET_TRAINER_MODEL_PATH=str(model_dir),
            LORAFLEET_TRAINER_NUM_SLOTS="2",
            LORAFLEET_TRAINER_MAX_RANK="64",
            LORAFLEET_TRAINER_STORAGE_ROOT=str(root / "trainer"),
            LORAFLEET_TRAINER_TORCH_THREADS=str(torch.get_num_threads()),
            LORAFLEET_TRAINER_CONTROLLER_ADDRESS=f"127.0.0.1:{ctl_port}",
            LORAFLEET_TRAINER_REPLICA_ID="trainer-0",
            LORAFLEET_TRAINER_LOG_LEVEL="WARNING",
        )
        try:
            with (
                service_process("lorafleet_controller", ctl_port, ctl_env, root / "c.log"),
                service_process("lorafleet_trainer", tr_port, tr_env, root / "t.log"),
            ):
                ctl_channel = make_channel(f"127.0.0.1:{ctl_port}")
                tr_channel = make_channel(f"127.0.0.1:{tr_port}")
                await wait_serving(tr_channel, "lorafleet.v1.TrainerService", within=300)
                controller = ThroughController(ctl_channel)
                slot = await controller.register()
                direct = Direct(tr_channel, 1 - slot)
                await direct.bind()
                ids, targets = make_batch(
                    int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
                )
                fb = fb_input(ids, targets)
                times: dict[str, list[float]] = {"direct": [], "controller": []}
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    await direct.step(fb)
                    t1 = time.perf_counter()
                    await controller.step(fb)
                    t2 = time.perf_counter()
                    if i >= warmup:
                        times["direct"].append(t1 - t0)
                        times["controller"].append(t2 - t1)
                await ctl_channel.close()
                await tr_channel.close()
        finally:
            redis.stop()
    tokens = BATCH * SEQ
    direct_tps = tokens / statistics.median(times["direct"])
    controller_tps = tokens / statistics.median(times["controller"])
    return {
        "bench": "controller_overhead",
        "model": model_name,
        "batch": [BATCH, SEQ],
        "rank": RANK,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "direct_tokens_per_s": round(direct_tps, 1),
        "controller_tokens_per_s": round(controller_tps, 1),
        "median_overhead_ms": round(
            (statistics.median(times["controller"]) - statistics.median(times["direct"])) * 1e3,
            1,
        ),
        "ratio": round(controller_tps / direct_tps, 3),
        "target_ratio": 0.9,
        "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    sys.stdout.write(json.dumps(asyncio.run(main(args.steps, args.warmup))) + "\n")
