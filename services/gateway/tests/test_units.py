"""Small units that need no server: settings/entrypoint, signed download tokens, the tar."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from lorafleet import contract, errors
from lorafleet.contract import TinkerPath
from lorafleet.settings import SettingsError
from lorafleet.testing import child_env
from lorafleet.v1 import common_pb2 as pb
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import archive, views
from lorafleet_gateway.serving import futures
from lorafleet_gateway.settings import GatewaySettings
from lorafleet_gateway.signing import Signer, load_secret
from lorafleet_gateway.tinker_proto import tinker_public_pb2 as tpb


def test_bad_setting_is_one_line_and_exit_2() -> None:
    env = child_env(LORAFLEET_GATEWAY_LONG_POLL_SECONDS="99")
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: LORAFLEET_GATEWAY_LONG_POLL_SECONDS=99.0: must be <= 40.0"
    ]


def test_lora_option_defaults_are_a_validated_setting() -> None:
    settings = GatewaySettings(lora_defaults="alpha=16; target_modules=q_proj,v_proj")
    assert settings.lora_option_defaults == contract.LoraOptions(
        alpha=16.0, target_modules=("q_proj", "v_proj")
    )
    assert GatewaySettings().lora_option_defaults == contract.LoraOptions()
    env = child_env(LORAFLEET_GATEWAY_LORA_DEFAULTS="alpha=0")
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_gateway"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: LORAFLEET_GATEWAY_LORA_DEFAULTS='alpha=0': ")
    assert "lorafleet.alpha" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_download_tokens_are_signed_and_expire() -> None:
    signer = Signer(b"k" * 32)
    token = signer.sign("tenant-a", "tinker://s:train:0/weights/x", time.time() + 60)
    assert signer.verify(token) == ("tenant-a", "tinker://s:train:0/weights/x")
    with pytest.raises(errors.PermissionDenied):
        Signer(b"other" * 8).verify(token)
    payload, _, mac = token.partition(".")
    with pytest.raises(errors.PermissionDenied):
        signer.verify(payload[:-2] + "AA." + mac)
    with pytest.raises(errors.Expired):
        signer.verify(signer.sign("t", "p", time.time() - 1))
    for garbage in ("(\x1a.\x9a\xf0", "é.ü", "\udcff.x"):  # found by the OpenAPI fuzz test
        with pytest.raises(errors.PermissionDenied):
            signer.verify(garbage)


def read_tar(raw: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def file_chunks(name: str, data: bytes, block: int) -> list[pb.FileChunk]:
    """A file as DownloadCheckpoint streams it: size on the first chunk, SHA-256 on the last."""
    offsets = list(range(0, len(data), block)) or [0]
    return [
        pb.FileChunk(
            path=name,
            offset=off,
            data=data[off : off + block],
            size_bytes=len(data) if off == 0 else 0,
            sha256=hashlib.sha256(data).hexdigest() if off == offsets[-1] else "",
        )
        for off in offsets
    ]


def test_tar_stream_holds_every_file_and_the_marker() -> None:
    """Members start before their bytes are all there (the size comes from the first chunk)."""
    weights = bytes(range(256)) * 4 + b"\x01" * 5
    chunks = file_chunks("adapter_config.json", b"{}", 100) + file_chunks(
        "adapter_model.safetensors", weights, 300
    )

    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def collect() -> bytes:
        parts = [c async for c in archive.tar_stream(chunks[0], rest())]
        return b"".join(parts)

    members = read_tar(asyncio.run(collect()))
    assert members == {
        "adapter_config.json": b"{}",
        "adapter_model.safetensors": weights,
        archive.COMPLETE_MARKER: b"",
    }


def test_tinker_ids_and_paths() -> None:
    assert views.session_of("s-1:train:3") == "s-1"
    with pytest.raises(errors.InvalidArgument):
        views.session_of("s-1:sample:3")
    external = TinkerPath.parse("tinker://r:train:0/external_weights/a")
    assert views.controller_path(external) == "tinker://r:train:0/weights/external.a"
    weights = TinkerPath.parse("tinker://r:train:0/weights/a")
    assert views.controller_path(weights) == str(weights) == "tinker://r:train:0/weights/a"


def test_download_key_is_shared_persistent_and_never_per_process(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "download-secret"
    first = load_secret("", str(key_file), "P_")
    assert load_secret("", str(key_file), "P_") == first  # a restart or a second replica
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert load_secret("s" * 40, str(key_file), "P_") == b"s" * 40  # the setting wins
    with pytest.raises(SettingsError, match="P_DOWNLOAD_SECRET"):
        load_secret("short", str(key_file), "P_")
    token = Signer(first).sign("t", "tinker://r:train:0/weights/a", time.time() + 60)
    assert Signer(load_secret("", str(key_file), "P_")).verify(token)[0] == "t"


def test_queue_state_comes_from_waiting_for() -> None:
    def state(waiting_for: int) -> str:
        op = cpb.Operation(state=cpb.OPERATION_STATE_QUEUED, waiting_for=waiting_for)
        return futures.try_again("op:x", op).queue_state

    assert state(cpb.WAITING_FOR_SLOT) == state(cpb.WAITING_FOR_TRAINER) == "paused_capacity"
    assert state(cpb.WAITING_FOR_SEQUENCE) == state(cpb.WAITING_FOR_DISPATCH) == "active"
    assert state(cpb.WAITING_FOR_UNSPECIFIED) == "active"


def test_non_finite_results_are_a_user_error_in_json_and_exact_in_protobuf() -> None:
    """A loss that overflowed float32 (weights of 1e38) never reaches the JSON encoder."""
    lps = np.array([-1.5, -2.0], dtype="<f4")
    losses = np.array([np.inf, 2e38], dtype="<f4")
    datum = pb.DatumOutput()
    for name, arr in (("logprobs", lps), ("elementwise_loss", losses)):
        datum.outputs[name].CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=arr.tobytes())
        )
    fb = pb.ForwardBackwardOutput(outputs=[datum], metrics={"loss:sum": math.inf})
    op = cpb.Operation(
        operation_id="o",
        state=cpb.OPERATION_STATE_SUCCEEDED,
        result=cpb.OperationResult(forward_backward=fb).SerializeToString(),
    )
    reply = futures.render(op, accept_proto=False)
    body = json.loads(reply.body)
    assert reply.media_type == "application/json" and body["category"] == "user"
    assert body["error"].startswith("loss_fn_outputs[0].elementwise_loss: non-finite"), body
    proto = tpb.ForwardBackwardOutput.FromString(futures.render(op, accept_proto=True).body)
    got = np.frombuffer(proto.loss_fn_outputs[0].fields["elementwise_loss"].data, "<f4")
    assert got.tobytes() == losses.tobytes() and math.isinf(proto.metrics["loss:sum"])
    optim = cpb.Operation(
        state=cpb.OPERATION_STATE_SUCCEEDED,
        result=cpb.OperationResult(
            optim_step=pb.OptimStepOutput(metrics={"grad_norm": math.nan})
        ).SerializeToString(),
    )
    assert json.loads(futures.render(optim, accept_proto=False).body)["error"].startswith(
        "metrics.grad_norm: non-finite"
    )
