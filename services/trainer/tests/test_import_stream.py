"""ImportAdapter over real gRPC: the chunked receive goes through lorafleet.staging's walls.

A `../` path and a stream past LORAFLEET_TRAINER_MAX_ADAPTER_BYTES are refused with
InvalidArgument naming the chunk field, nothing is written outside the staging folder and no
staging folder is left behind; an adapter the trainer exported imports back through the same
path (the walls do not refuse what is legitimate).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import pytest

from lorafleet.errors import InvalidArgument
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import child_env, free_port, service_process, wait_serving
from lorafleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

MAX_BYTES = 256 * 1024
REFUSALS = 20
HEADER = trainer_pb2.ImportAdapterHeader(operation_id="imp-1", slot=0, registration_id="reg-a")


@pytest.fixture
def service(model_dir: Path, tmp_path: Path):
    port = free_port()
    scratch = tmp_path / "tmp"  # the trainer's TMPDIR: where its staging folders go
    scratch.mkdir()
    env = child_env(
        LORAFLEET_TRAINER_PORT=str(port),
        LORAFLEET_TRAINER_MODEL_PATH=str(model_dir),
        LORAFLEET_TRAINER_NUM_SLOTS="1",
        LORAFLEET_TRAINER_MAX_RANK="8",
        LORAFLEET_TRAINER_STORAGE_ROOT=str(tmp_path / "states"),
        LORAFLEET_TRAINER_TORCH_THREADS="1",
        LORAFLEET_TRAINER_MAX_ADAPTER_BYTES=str(MAX_BYTES),
        TMPDIR=str(scratch),
    )
    with service_process("lorafleet_trainer", port, env, tmp_path / "trainer.log"):
        yield port, scratch


async def _stream(
    chunks: Iterable[common_pb2.FileChunk],
) -> AsyncIterator[trainer_pb2.ImportAdapterChunk]:
    yield trainer_pb2.ImportAdapterChunk(header=HEADER)
    for chunk in chunks:
        yield trainer_pb2.ImportAdapterChunk(chunk=chunk)


async def _refused(stub: trainer_pb2_grpc.TrainerServiceStub, chunks) -> InvalidArgument:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ImportAdapter(_stream(chunks), timeout=120)
    exc = from_rpc_error(err.value)
    assert isinstance(exc, InvalidArgument), exc
    return exc


def _endless(path: str) -> Iterable[common_pb2.FileChunk]:
    """64 MiB in order, 64 KiB at a time: far past the cap, made only as it is read."""
    block = b"x" * (64 * 1024)
    for i in range(1024):
        yield common_pb2.FileChunk(path=path, offset=i * len(block), data=block)


async def test_import_refuses_traversal_and_oversize_and_takes_an_export(
    service, tmp_path: Path
) -> None:
    port, scratch = service
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await wait_serving(channel, "lorafleet.v1.TrainerService")
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        cfg = common_pb2.LoraConfig(rank=4, seed=3, train_attn=True, train_mlp=True)
        await stub.BindSlot(
            trainer_pb2.BindSlotRequest(slot=0, registration_id="reg-a", lora_config=cfg),
            timeout=30,
        )

        escapes = ["../adapter_config.json", "../../escaped", "/etc/escaped", "a/../../escaped"]
        for path in escapes:
            exc = await _refused(stub, [common_pb2.FileChunk(path=path, offset=0, data=b"{}")])
            assert exc.field == "chunk.path", (path, exc)
        assert not (tmp_path / "adapter_config.json").exists()
        assert not (tmp_path / "escaped").exists()

        # A refusal while the client is still writing: grpc aio clients report INTERNAL for it
        # unless the server reads the stream out first (grpc#36066), so refuse it repeatedly.
        for _ in range(REFUSALS):
            exc = await _refused(stub, _endless("adapter_model.safetensors"))
            assert (exc.field, exc.reason) == ("chunk.data", "TOO_LARGE")
            assert str(MAX_BYTES) in exc.message

        exported = [
            c.chunk
            async for c in stub.ExportAdapter(
                trainer_pb2.ExportAdapterRequest(slot=0, registration_id="reg-a"), timeout=120
            )
        ]
        assert 0 < sum(len(c.data) for c in exported) <= MAX_BYTES
        await stub.ImportAdapter(_stream(exported), timeout=120)
    assert list(scratch.glob(".staging-*")) == []  # every staging folder was removed
