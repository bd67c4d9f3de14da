"""The shared runtime, exercised through real processes and real gRPC."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from lorafleet import errors
from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.rpc.server import ServiceSpec, start_server
from lorafleet.settings import ServerSettings
from lorafleet.testing import child_env, stop_process, wait_for_port

HERE = Path(__file__).parent


async def _health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return resp.status


def test_subprocess_service_health_and_graceful_sigterm(port: int) -> None:
    env = child_env(LORAFLEET_TEST_PORT=str(port), LORAFLEET_TEST_GRACE_SECONDS="5")
    proc = subprocess.Popen([sys.executable, str(HERE / "runtime_server.py")], env=env)
    try:
        wait_for_port(port, proc=proc)
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = asyncio.run(_health(port, "test.Sleep"))
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert asyncio.run(_health(port, "")) == health_pb2.HealthCheckResponse.SERVING

        async def in_flight_then_sigterm() -> bytes:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary("/test.Sleep/Sleep")(b"1.0", timeout=10)
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                return await call

        started = time.monotonic()
        assert asyncio.run(in_flight_then_sigterm()) == b"slept"
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 5 + 2
    finally:
        stop_process(proc)


def test_bad_setting_exits_with_one_line(port: int) -> None:
    env = child_env(LORAFLEET_TEST_PORT="eighty")
    out = subprocess.run(
        [sys.executable, str(HERE / "runtime_server.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: LORAFLEET_TEST_PORT='eighty': expected an integer"]


async def test_domain_errors_map_to_status_and_back() -> None:
    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"busy":
            raise errors.ResourceExhausted("queue full", retry_after=2.5, field="seq_id")
        raise errors.InvalidArgument("must be finite", field="adam_params.learning_rate")

    def add(servicer: object, server: grpc.aio.Server) -> None:
        handler = grpc.method_handlers_generic_handler(
            "test.Fail", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}
        )
        server.add_generic_rpc_handlers((handler,))

    running = await start_server(ServerSettings(port=0), [ServiceSpec(None, add, "test.Fail")])
    try:
        async with make_channel(f"127.0.0.1:{running.port}") as ch:
            method = ch.unary_unary("/test.Fail/Fail")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(b"x", timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            err = from_rpc_error(info.value)
            assert isinstance(err, errors.InvalidArgument)
            assert (err.field, err.message) == ("adam_params.learning_rate", "must be finite")

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(b"busy", timeout=5)
            err = from_rpc_error(info.value)
            assert isinstance(err, errors.ResourceExhausted) and err.retry_after == 2.5
    finally:
        await running.stop()
    handled = REGISTRY.get_sample_value(
        "grpc_server_handled_total",
        {
            "grpc_type": "unary",
            "grpc_service": "test.Fail",
            "grpc_method": "Fail",
            "grpc_code": "INVALID_ARGUMENT",
        },
    )
    assert handled == 1.0
