"""`python -m lorafleet_controller`: the ControllerService over Redis.

Settings come from LORAFLEET_CONTROLLER_* (see `--help`) and the server's from the same
prefix (host, port, metrics_port, ...). Bad settings, an unreachable Redis or an unusable
Kubernetes configuration print one line and exit 2, before anything listens.

With LEADER_ELECTION on, every replica answers RPCs but only the Lease holder dispatches;
the others report `lorafleet.v1.ControllerService` NOT_SERVING (the overall health stays
SERVING, so liveness holds) and the chart's readiness probe routes traffic to the leader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import urllib.parse
from typing import TYPE_CHECKING

from lorafleet.settings import ServerSettings, SettingsError, load_or_exit
from lorafleet.shared_storage import check_root
from lorafleet_controller.settings import PREFIX, ControllerSettings

if TYPE_CHECKING:
    from lorafleet_controller.discovery.leader import LeaderElector
    from lorafleet_controller.discovery.types import Discovery

SERVICE = "lorafleet.v1.ControllerService"
JOB_SERVICE = "lorafleet.v1.JobService"
log = logging.getLogger("lorafleet_controller")


def without_password(url: str) -> str:
    """`url` with its password (the chart's generated one) replaced by ***: errors are read
    in logs that more people see than the Secret."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def main() -> None:
    settings = load_or_exit(ControllerSettings, PREFIX)
    server = load_or_exit(ServerSettings, PREFIX)
    if settings.shared_adapter_root is not None:
        try:
            root = check_root(settings.shared_adapter_root, f"{PREFIX}SHARED_ADAPTER_ROOT")
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        settings = dataclasses.replace(settings, shared_adapter_root=root)

    from lorafleet.errors import LorafleetError
    from lorafleet.logging import setup_logging
    from lorafleet_controller import cluster, store

    if (why := store.unreachable(settings.redis_url, cluster=settings.redis_cluster)) is not None:
        where = without_password(settings.redis_url)
        print(f"error: cannot reach Redis at {where}: {why}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        discovery = cluster.build_discovery(settings)
        if settings.leader_election:
            cluster.check_lease_timings(settings)
            cluster.kube_api_client()
    except LorafleetError as exc:
        print(f"error: {PREFIX}{exc.field.upper()}: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as exc:  # kubernetes ConfigException and friends
        print(f"error: no usable Kubernetes configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    setup_logging("controller", server.log_level)
    asyncio.run(run(settings, server, discovery))


async def run(
    settings: ControllerSettings, server: ServerSettings, discovery: Discovery | None
) -> None:
    """Serve until SIGTERM/SIGINT; with leader election, dispatch only while leading."""
    from grpc_health.v1 import health_pb2
    from prometheus_client import start_http_server

    from lorafleet.rpc.server import ServiceSpec, start_server
    from lorafleet.v1 import controller_pb2_grpc, jobs_pb2_grpc
    from lorafleet_controller import cluster
    from lorafleet_controller.controller import Controller
    from lorafleet_controller.jobs_servicer import JobServicer
    from lorafleet_controller.servicer import ControllerServicer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.metrics_port:
        start_http_server(server.metrics_port, addr=server.host)

    elector: LeaderElector | None = None  # built once the server runs (it reports health)

    def is_leader() -> bool:
        """Without election this controller always dispatches; with it, while the lease is
        safely held (and the store's epoch fences it once a newer leader took over)."""
        return not settings.leader_election or (elector is not None and elector.is_leader)

    controller = Controller(settings, discovery=discovery, is_leader=is_leader)
    spec = ServiceSpec(
        servicer=ControllerServicer(controller),
        add_fn=controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        full_name=SERVICE,
    )
    jobs = ServiceSpec(
        servicer=JobServicer(controller.jobs),
        add_fn=jobs_pb2_grpc.add_JobServiceServicer_to_server,
        full_name=JOB_SERVICE,
    )
    running = await start_server(
        server,
        [spec, jobs],
        lambda: controller.start(lead=not settings.leader_election),
        # NOT_SERVING until the lease is ours
        standby=(SERVICE,) if settings.leader_election else (),
    )
    status = health_pb2.HealthCheckResponse

    async def started_leading() -> None:
        await controller.start_leading()
        if not stop.is_set():
            await running.health.set(SERVICE, status.SERVING)

    async def stopped_leading() -> None:
        if not stop.is_set():
            await running.health.set(SERVICE, status.NOT_SERVING)
        await controller.stop_leading()

    campaign = None
    if settings.leader_election:
        elector = cluster.build_elector(settings, started_leading, stopped_leading)
        campaign = asyncio.create_task(elector.run(), name="leader-election")
    log.info("controller serving on %s:%d", server.host, running.port)
    await stop.wait()
    log.info("controller stopping: draining for up to %.1fs", server.grace_seconds)
    await running.health.enter_graceful_shutdown()
    if campaign is not None:  # step down and release the lease: a standby takes over now
        campaign.cancel()
        await asyncio.gather(campaign, return_exceptions=True)
    await running.server.stop(server.grace_seconds)
    await controller.stop()
    log.info("controller stopped")


if __name__ == "__main__":
    main()
