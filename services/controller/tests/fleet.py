"""Real processes for integration tests: redis-server, the controller, tiny-model trainers."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from pathlib import Path

import grpc

from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import (
    WAIT_SECONDS,
    RedisServer,
    child_env,
    free_port,
    stop_process,
    wait_for_port,
    wait_until_async,
)
from lorafleet.v1 import common_pb2, controller_pb2, controller_pb2_grpc, trainer_pb2_grpc

K = controller_pb2


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.args, self.env, self.port, self.log = args, env, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = WAIT_SECONDS) -> None:
        self.launch()
        self.wait(timeout)

    def launch(self) -> None:
        """Start the process without waiting: several can import torch side by side."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=out)

    def wait(self, timeout: float = WAIT_SECONDS) -> None:
        assert self.proc is not None
        wait_for_port(self.port, timeout=timeout, proc=self.proc)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=5)


def controller_proc(redis: RedisServer, root: Path, **env: str) -> Proc:
    port = free_port()
    e = child_env(
        LORAFLEET_CONTROLLER_REDIS_URL=redis.url,
        LORAFLEET_CONTROLLER_PORT=str(port),
        LORAFLEET_CONTROLLER_STORAGE_ROOT=str(root / "controller-storage"),
        LORAFLEET_CONTROLLER_SWEEP_INTERVAL_SECONDS="0.2",
        LORAFLEET_CONTROLLER_TRANSPORT_RETRY_SECONDS="10",
        **env,
    )
    return Proc([sys.executable, "-m", "lorafleet_controller"], e, port, root / "controller.log")


def trainer_proc(
    model: Path, controller_port: int, root: Path, replica: str, slots: int = 4
) -> Proc:
    port = free_port()
    e = child_env(
        LORAFLEET_TRAINER_MODEL_PATH=str(model),
        LORAFLEET_TRAINER_PORT=str(port),
        LORAFLEET_TRAINER_NUM_SLOTS=str(slots),
        LORAFLEET_TRAINER_STORAGE_ROOT=str(root / "trainer-states"),
        LORAFLEET_TRAINER_REPLICA_ID=replica,
        LORAFLEET_TRAINER_CONTROLLER_ADDRESS=f"127.0.0.1:{controller_port}",
        LORAFLEET_TRAINER_REGISTER_INTERVAL_SECONDS="0.5",
        LORAFLEET_TRAINER_TORCH_THREADS="1",
    )
    return Proc([sys.executable, "-m", "lorafleet_trainer"], e, port, root / f"{replica}.log")


def rollout_proc(
    model: Path,
    controller_port: int,
    root: Path,
    replica: str,
    *,
    port: int = 0,
    register: bool = True,
    **env: str,
) -> Proc:
    """A rollout; `register=False` leaves it to the controller's discovery to find it."""
    port = port or free_port()
    e = child_env(
        LORAFLEET_ROLLOUT_MODEL_PATH=str(model),
        LORAFLEET_ROLLOUT_PORT=str(port),
        LORAFLEET_ROLLOUT_ADAPTER_DIR=str(root / f"{replica}-adapters"),
        LORAFLEET_ROLLOUT_REPLICA_ID=replica,
        LORAFLEET_ROLLOUT_CONTROLLER_ADDRESS=f"127.0.0.1:{controller_port}" if register else "",
        LORAFLEET_ROLLOUT_REGISTER_INTERVAL_SECONDS="0.5",
        LORAFLEET_ROLLOUT_TORCH_THREADS="1",
        **env,
    )
    return Proc([sys.executable, "-m", "lorafleet_rollout"], e, port, root / f"{replica}.log")


class Client:
    """A ControllerService client that raises domain errors."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)

    async def __call__(self, method: str, request: object, deadline: float = 30) -> object:
        try:
            return await getattr(self.stub, method)(request, timeout=deadline)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self.channel.close()


def tensor(values: list[float] | list[int], integer: bool) -> common_pb2.Tensor:
    fmt = f"<{len(values)}{'q' if integer else 'f'}"
    return common_pb2.Tensor(
        dtype=common_pb2.DTYPE_INT64 if integer else common_pb2.DTYPE_FLOAT32,
        shape=[len(values)],
        data=struct.pack(fmt, *values),
    )


def fb_payload(tokens: list[int], forward_only: bool = False) -> controller_pb2.OperationPayload:
    datum = common_pb2.Datum(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tensor(tokens[1:], True),
            "weights": tensor([1.0] * (len(tokens) - 1), False),
        },
    )
    fb = common_pb2.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    return (
        K.OperationPayload(forward=fb) if forward_only else K.OperationPayload(forward_backward=fb)
    )


def optim_payload(lr: float = 1e-2) -> controller_pb2.OperationPayload:
    return K.OperationPayload(
        optim_step=common_pb2.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)
    )


async def wait_for_model(client: Client, within: float = WAIT_SECONDS) -> str:
    """The base model name once a trainer has registered."""

    async def trainable() -> str:
        caps = await client("GetCapabilities", K.GetCapabilitiesRequest())
        return next((str(m.name) for m in caps.models if m.trainable), "")  # type: ignore[attr-defined]

    return await wait_until_async(trainable, "a trainer registered", within)


async def wait_done(client: Client, tenant: str, opid: str, within: float = WAIT_SECONDS) -> object:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        resp = await client(
            "GetOperation",
            K.GetOperationRequest(tenant=tenant, operation_id=opid, wait_seconds=5),
            deadline=15,
        )
        op = resp.operation  # type: ignore[attr-defined]
        if op.state not in (K.OPERATION_STATE_QUEUED, K.OPERATION_STATE_CLAIMED):
            return op
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{opid} still {op.state} ({op.waiting_reason})")


def trainer_stub(port: int) -> trainer_pb2_grpc.TrainerServiceStub:
    return trainer_pb2_grpc.TrainerServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
