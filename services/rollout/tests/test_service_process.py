"""The real rollout service as a subprocess, driven over gRPC: push, sample, errors, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from rollout_helpers import adapter_chunks, make_adapter, reference_greedy, reference_model

from lorafleet import testing
from lorafleet.errors import InvalidArgument, NotFound
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import child_env, free_port, service_process
from lorafleet.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def test_bad_settings_exit_2_with_one_line(tmp_path: Path) -> None:
    env = child_env(
        LORAFLEET_ROLLOUT_MODEL_PATH=str(tmp_path), LORAFLEET_ROLLOUT_MAX_BATCH_SIZE="0"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_rollout"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: LORAFLEET_ROLLOUT_MAX_BATCH_SIZE=0: must be >= 1"
    ]


@pytest.fixture
def service(model_dir: Path, tmp_path: Path):
    port = free_port()
    env = child_env(
        LORAFLEET_ROLLOUT_MODEL_PATH=str(model_dir),
        LORAFLEET_ROLLOUT_PORT=str(port),
        LORAFLEET_ROLLOUT_ADAPTER_DIR=str(tmp_path / "adapters"),
        LORAFLEET_ROLLOUT_CONTROLLER_ADDRESS=f"127.0.0.1:{free_port()}",  # nobody listens
        LORAFLEET_ROLLOUT_TORCH_THREADS="1",
        LORAFLEET_ROLLOUT_WARM_MEMORY_BYTES=str(64 << 20),
    )
    with service_process("lorafleet_rollout", port, env, tmp_path / "rollout.log") as proc:
        yield proc, f"127.0.0.1:{port}"


async def test_push_sample_and_sigterm(service, model_dir: Path, tmp_path: Path) -> None:
    proc, address = service
    adapter = make_adapter(model_dir, tmp_path / "a1", seed=1)
    async with grpc.aio.insecure_channel(address) as channel:
        await testing.wait_serving(channel, "lorafleet.v1.RolloutService")
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        info = await stub.GetRolloutInfo(rollout_pb2.GetRolloutInfoRequest(), timeout=60)
        assert info.engine == "torch" and info.max_context_length > 0
        # The torch engine's process re-executed itself with its heap settings, then warmed.
        started = (tmp_path / "rollout.log").read_text()
        assert "heap kept (GLIBC_TUNABLES" in started
        assert "warmed 67108864 bytes" in started

        loaded = await stub.LoadAdapter(iter(adapter_chunks("reg-1", 1, adapter)), timeout=60)
        assert (loaded.adapter_id, loaded.already_loaded) == ("reg-1@1", False)
        again = await stub.LoadAdapter(iter(adapter_chunks("reg-1", 1, adapter)), timeout=60)
        assert again.already_loaded

        prompt = [5, 17, 33, 90, 12]
        request = rollout_pb2.SampleRequest(
            adapter=common_pb2.AdapterRef(registration_id="reg-1", version=1),
            prompt_tokens=prompt,
            params=common_pb2.SamplingParams(max_tokens=8, temperature=0.0, disable_eos_stop=True),
        )
        reply = await stub.Sample(request, timeout=60)
        (seq,) = reply.output.sequences
        assert list(seq.tokens) == reference_greedy(reference_model(model_dir, adapter), prompt, 8)
        assert len(seq.logprobs) == 8 and seq.stop_reason == common_pb2.STOP_REASON_LENGTH

        request.adapter.version = 2
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Sample(request, timeout=60)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        err = from_rpc_error(missing.value)
        assert isinstance(err, NotFound) and err.field == "adapter.version"

        request.adapter.version = 1
        request.prompt_tokens[1] = 10**6
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Sample(request, timeout=60)
        err = from_rpc_error(bad.value)
        assert isinstance(err, InvalidArgument) and err.field == "prompt_tokens[1]"

        corrupt = adapter_chunks("reg-2", 1, adapter)
        corrupt[0].header.file_sha256["adapter_config.json"] = "0" * 64
        for m in corrupt[1:]:
            m.chunk.sha256 = ""
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.LoadAdapter(iter(corrupt), timeout=60)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        listed = await stub.ListAdapters(rollout_pb2.ListAdaptersRequest(), timeout=5)
        assert [a.adapter_id for a in listed.adapters] == ["reg-1@1"]

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
