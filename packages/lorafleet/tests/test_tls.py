"""Mutual TLS through the shared server and channel factories, with trustme certificates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.server import RunningServer, ServiceSpec, start_server
from lorafleet.settings import ServerSettings, SettingsError, TlsSettings
from lorafleet.testing import child_env, free_port
from lorafleet.tls import TlsIdentity, identity_from_settings

ADMIN_METHOD = "/lorafleet.v1.ControllerService/CreateApiKey"
PLAIN_METHOD = "/lorafleet.v1.ControllerService/GetCapabilities"


def _identity(ca: trustme.CA, name: str) -> TlsIdentity:
    cert = ca.issue_cert("127.0.0.1", "localhost", common_name=name)
    return TlsIdentity(
        ca=ca.cert_pem.bytes(),
        cert=b"".join(c.bytes() for c in cert.cert_chain_pems),
        key=cert.private_key_pem.bytes(),
    )


def _add(servicer: object, server: grpc.aio.Server) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"ok:" + request

    handler = grpc.method_handlers_generic_handler(
        "lorafleet.v1.ControllerService",
        {
            name: grpc.unary_unary_rpc_method_handler(echo)
            for name in ("CreateApiKey", "GetCapabilities")
        },
    )
    server.add_generic_rpc_handlers((handler,))


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def server(ca: trustme.CA) -> AsyncIterator[RunningServer]:
    spec = ServiceSpec(None, _add, "lorafleet.v1.ControllerService")
    running = await start_server(ServerSettings(port=0), [spec], tls=_identity(ca, "controller"))
    try:
        yield running
    finally:
        await running.stop()


async def _call(channel: grpc.aio.Channel, method: str) -> bytes:
    return bytes(await channel.unary_unary(method)(b"x", timeout=10))


async def test_service_certificate_calls_plain_rpcs_but_not_admin_ones(
    server: RunningServer, ca: trustme.CA
) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", tls=_identity(ca, "gateway")) as ch:
        assert await _call(ch, PLAIN_METHOD) == b"ok:x"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(ch, ADMIN_METHOD)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "CreateApiKey needs an operator certificate (caller: gateway)" in info.value.details()


async def test_admin_certificate_calls_admin_rpcs(server: RunningServer, ca: trustme.CA) -> None:
    admin = _identity(ca, "lorafleet-admin")
    async with make_channel(f"127.0.0.1:{server.port}", tls=admin) as ch:
        assert await _call(ch, ADMIN_METHOD) == b"ok:x"


async def test_callers_without_a_fleet_certificate_are_refused(
    server: RunningServer, ca: trustme.CA
) -> None:
    address = f"127.0.0.1:{server.port}"
    stranger = _identity(trustme.CA(), "lorafleet-admin")  # right name, wrong CA
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    channels = [
        grpc.aio.insecure_channel(address),
        grpc.aio.secure_channel(address, no_client_cert),
        make_channel(address, tls=TlsIdentity(ca.cert_pem.bytes(), stranger.cert, stranger.key)),
    ]
    for channel in channels:
        async with channel:
            for method in (PLAIN_METHOD, ADMIN_METHOD):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _call(channel, method)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_settings_need_all_three_readable_pem_files(tmp_path: Path) -> None:
    assert identity_from_settings(TlsSettings()) is None
    pem = tmp_path / "ca.crt"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(SettingsError, match="LORAFLEET_TLS_KEY_FILE must be set too"):
        identity_from_settings(TlsSettings(ca_file=pem, cert_file=pem))
    with pytest.raises(SettingsError, match=r"LORAFLEET_TLS_KEY_FILE=.*missing.key: No such"):
        identity_from_settings(TlsSettings(pem, pem, tmp_path / "missing.key"))
    (tmp_path / "k").write_text("not a key")
    with pytest.raises(SettingsError, match=r"LORAFLEET_TLS_KEY_FILE=.*: not a PEM file"):
        identity_from_settings(TlsSettings(pem, pem, tmp_path / "k"))


def test_a_service_with_half_its_tls_settings_exits_with_one_line(port: int) -> None:
    env = child_env(LORAFLEET_TEST_PORT=str(port), LORAFLEET_TLS_CA_FILE="/nonexistent/ca.crt")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "runtime_server.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: LORAFLEET_TLS_CERT_FILE, LORAFLEET_TLS_KEY_FILE must be set too: TLS needs "
        "all of CA, certificate and key"
    ]


async def test_health_port_answers_probes_in_plaintext_and_nothing_else(ca: trustme.CA) -> None:
    spec = ServiceSpec(None, _add, "lorafleet.v1.ControllerService")
    settings = ServerSettings(port=0, health_port=free_port())
    running = await start_server(settings, [spec], tls=_identity(ca, "controller"))
    try:
        assert running.health_port == settings.health_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.health_port}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="lorafleet.v1.ControllerService"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _call(ch, ADMIN_METHOD)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await running.stop()
