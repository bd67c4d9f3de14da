"""The controller process over gRPC without replicas: tenancy, sessions, start-up errors."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet.testing import RedisServer, child_env, free_port, wait_until_async
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


async def test_api_keys_store_only_hashes(client: Client, redis_server: RedisServer) -> None:
    created = await client("CreateApiKey", K.CreateApiKeyRequest(tenant="acme", label="ci"))
    key = created.api_key  # type: ignore[attr-defined]
    assert key.startswith("tml-")
    auth = await client("Authenticate", K.AuthenticateRequest(api_key=key))
    assert auth.tenant == "acme"  # type: ignore[attr-defined]
    r = aioredis.from_url(redis_server.url)
    stored = [k async for k in r.scan_iter()]
    for k in stored:
        if await r.type(k) == b"hash":
            stored += list((await r.hgetall(k)).values())
    await r.aclose()
    assert not any(key.encode() in blob for blob in stored)
    keys = await client("ListApiKeys", K.ListApiKeysRequest(tenant="acme"))
    assert [k.label for k in keys.keys] == ["ci"]  # type: ignore[attr-defined]
    await client("RevokeApiKey", K.RevokeApiKeyRequest(key_id=created.key_id))  # type: ignore[attr-defined]
    with pytest.raises(errors.PermissionDenied):
        await client("Authenticate", K.AuthenticateRequest(api_key=key))
    with pytest.raises(errors.PermissionDenied):
        await client("Authenticate", K.AuthenticateRequest(api_key="tml-made-up"))


async def test_sessions_are_tenant_scoped(client: Client) -> None:
    sid = (
        await client("CreateSession", K.CreateSessionRequest(tenant="a", display_name="x"))
    ).session_id  # type: ignore[attr-defined]
    await client("SessionHeartbeat", K.SessionHeartbeatRequest(tenant="a", session_id=sid))
    with pytest.raises(errors.NotFound):
        await client("GetSession", K.GetSessionRequest(tenant="b", session_id=sid))
    listed = await client("ListSessions", K.ListSessionsRequest(tenant="a"))
    assert list(listed.session_ids) == [sid]  # type: ignore[attr-defined]
    await client("FinishSession", K.FinishSessionRequest(tenant="a", session_id=sid))
    info = await client("GetSession", K.GetSessionRequest(tenant="a", session_id=sid))
    assert info.session.finished  # type: ignore[attr-defined]
    with pytest.raises(errors.Expired):
        await client("SessionHeartbeat", K.SessionHeartbeatRequest(tenant="a", session_id=sid))
    with pytest.raises(errors.NotFound):  # registrations need the tenant's own session
        await client(
            "CreateRegistration",
            K.CreateRegistrationRequest(tenant="b", session_id=sid, base_model="m"),
        )


async def test_registration_needs_a_serving_trainer(client: Client) -> None:
    sid = (await client("CreateSession", K.CreateSessionRequest(tenant="a"))).session_id  # type: ignore[attr-defined]
    with pytest.raises(errors.InvalidArgument) as exc:
        await client(
            "CreateRegistration",
            K.CreateRegistrationRequest(tenant="a", session_id=sid, base_model="nope"),
        )
    assert exc.value.field == "base_model"
    status = await client("GetFleetStatus", K.GetFleetStatusRequest())
    assert list(status.replicas) == []  # type: ignore[attr-defined]


def test_bad_settings_and_unreachable_redis_exit_2() -> None:
    for env in (
        {"LORAFLEET_CONTROLLER_GAP_TIMEOUT_SECONDS": "soon"},
        {"LORAFLEET_CONTROLLER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"},
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "lorafleet_controller"],
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


async def test_silent_sessions_are_finished(redis_server: RedisServer, tmp_path: Path) -> None:
    proc = controller_proc(redis_server, tmp_path, LORAFLEET_CONTROLLER_SESSION_TIMEOUT_SECONDS="1")
    proc.start()
    c = Client(proc.port)
    try:
        new = [
            (await c("CreateSession", K.CreateSessionRequest(tenant="a"))).session_id  # type: ignore[attr-defined]
            for _ in range(2)
        ]
        silent, alive = new

        async def silent_finished() -> bool:  # only `alive` heartbeats meanwhile
            await c("SessionHeartbeat", K.SessionHeartbeatRequest(tenant="a", session_id=alive))
            gone = await c("GetSession", K.GetSessionRequest(tenant="a", session_id=silent))
            return bool(gone.session.finished)  # type: ignore[attr-defined]

        await wait_until_async(silent_finished, "the silent session finished")
        kept = await c("GetSession", K.GetSessionRequest(tenant="a", session_id=alive))
        assert not kept.session.finished  # type: ignore[attr-defined]
        with pytest.raises(errors.Expired):
            await c("SessionHeartbeat", K.SessionHeartbeatRequest(tenant="a", session_id=silent))
    finally:
        await c.close()
        proc.stop()


async def test_revoking_a_key_ends_the_sessions_it_opened(client: Client) -> None:
    keys = [
        (await client("CreateApiKey", K.CreateApiKeyRequest(tenant="a", label=n))).key_id  # type: ignore[attr-defined]
        for n in ("revoked", "kept")
    ]
    revoked, kept = [
        (await client("CreateSession", K.CreateSessionRequest(tenant="a", key_id=k))).session_id  # type: ignore[attr-defined]
        for k in keys
    ]
    await client("RevokeApiKey", K.RevokeApiKeyRequest(key_id=keys[0]))
    ended = await client("GetSession", K.GetSessionRequest(tenant="a", session_id=revoked))
    live = await client("GetSession", K.GetSessionRequest(tenant="a", session_id=kept))
    assert ended.session.finished and not live.session.finished  # type: ignore[attr-defined]
    with pytest.raises(errors.Expired):
        await client("SessionHeartbeat", K.SessionHeartbeatRequest(tenant="a", session_id=revoked))
    with pytest.raises(errors.PermissionDenied):  # a gateway's cached lookup opens nothing new
        await client("CreateSession", K.CreateSessionRequest(tenant="a", key_id=keys[0]))


def test_the_documented_session_timeout_is_the_default() -> None:
    """The README states the default the controller runs with (issue 23: they drifted)."""
    from lorafleet_controller.settings import ControllerSettings

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    stated = re.search(r"`LORAFLEET_CONTROLLER_SESSION_TIMEOUT_SECONDS` \((\d+) s\)", readme)
    assert stated is not None, "README no longer states the session timeout"
    (field,) = [
        f for f in dataclasses.fields(ControllerSettings) if f.name == "session_timeout_seconds"
    ]
    default = field.default
    assert float(stated.group(1)) == default == 120.0
