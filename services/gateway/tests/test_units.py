"""Small units that need no server: settings/entrypoint, signed download tokens, the tar."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from lorafleet import errors
from lorafleet.contract import TinkerPath
from lorafleet.testing import child_env
from lorafleet_gateway import archive, views
from lorafleet_gateway.signing import Signer


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


def test_tar_stream_holds_every_file_and_the_marker() -> None:
    async def rest():
        yield ("adapter_model.safetensors", b"\x01" * 1000)

    async def collect() -> bytes:
        parts = [c async for c in archive.tar_stream(("adapter_config.json", b"{}"), rest())]
        return b"".join(parts)

    members = archive.read_tar(asyncio.run(collect()))
    assert members == {
        "adapter_config.json": b"{}",
        "adapter_model.safetensors": b"\x01" * 1000,
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
