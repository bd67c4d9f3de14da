"""Two controller processes with leader election: only the Lease holder reports SERVING.

The processes reach the recorded-response API server of test_discovery.py through a
KUBECONFIG file, as a controller run outside a cluster would.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.testing import WAIT_SECONDS, RedisServer

from .fleet import Proc, controller_proc
from .test_discovery import LEASE, NS, FakeApiServer, apiserver  # noqa: F401

SERVICE = "lorafleet.v1.ControllerService"
SERVING = health_pb2.HealthCheckResponse.SERVING


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "fake", "user": {"token": "unused"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            }
        )
    )
    return path


async def serving(proc: Proc) -> tuple[bool, bool]:
    """(overall SERVING, ControllerService SERVING)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        overall = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        named = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        return overall.status == SERVING, named.status == SERVING


async def wait_for(procs: list[Proc], expected: list[tuple[bool, bool]], within: float) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while (seen := [await serving(p) for p in procs]) != expected:
        assert asyncio.get_running_loop().time() < deadline, seen
        await asyncio.sleep(0.05)


async def test_standby_is_not_ready_until_the_leader_leaves(
    apiserver: FakeApiServer,  # noqa: F811
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", apiserver.host)
    procs = []
    for i in range(2):
        root = tmp_path / f"c{i}"
        root.mkdir()
        procs.append(
            controller_proc(
                redis_server,
                root,
                KUBECONFIG=str(config),
                LORAFLEET_CONTROLLER_LEADER_ELECTION="1",
                LORAFLEET_CONTROLLER_NAMESPACE=NS,
                LORAFLEET_CONTROLLER_LEASE_NAME=LEASE,
                LORAFLEET_CONTROLLER_REPLICA_ID=f"c{i}",
                LORAFLEET_CONTROLLER_LEASE_DURATION_SECONDS="30",
                LORAFLEET_CONTROLLER_LEASE_RENEW_DEADLINE_SECONDS="20",
                LORAFLEET_CONTROLLER_LEASE_RETRY_PERIOD_SECONDS="0.2",
            )
        )
    try:
        procs[0].start()
        await wait_for(procs[:1], [(True, True)], within=WAIT_SECONDS)
        procs[1].start()
        await wait_for(
            procs, [(True, True), (True, False)], within=WAIT_SECONDS
        )  # alive, not ready
        assert apiserver.lease["spec"]["holderIdentity"] == "c0"
        # SIGTERM: c0 steps down and releases the lease, so c1 leads long before the 30 s
        # lease would have expired (that bound is what is tested; it leaves room for load).
        procs[0].stop()
        await wait_for(procs[1:], [(True, True)], within=25)
        assert apiserver.lease["spec"]["holderIdentity"] == "c1"
    finally:
        for p in procs:
            p.stop()
