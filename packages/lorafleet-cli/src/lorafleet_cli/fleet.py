"""Bring up the whole fleet on loopback as real processes, and take it down again.

Used by `lorafleet up` and by every end-to-end test, so the tests exercise exactly what a
user runs. Order: Redis (private, unless a URL is given) → controller → trainers →
rollouts → gateway; each must report healthy before the next starts. Every process is
recorded by PID in `<run_dir>/fleet.json` and stopped by that PID, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.testing import child_env, free_port, start_redis, stop_process
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

STATE_FILE = "fleet.json"


class FleetError(RuntimeError):
    """The fleet could not start; the message is one line an operator can act on."""


@dataclass
class FleetConfig:
    model_path: Path
    run_dir: Path
    trainers: int = 1
    rollouts: int = 1
    slots: int = 4
    gateway_port: int = 0
    gateway_host: str = "127.0.0.1"
    redis_url: str = ""
    tenant: str = "local"
    # Extra environment per service ("controller", "trainer", "rollout", "gateway").
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    start_timeout: float = 180.0


@dataclass
class Member:
    service: str
    name: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log: Path


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.members: list[Member] = []
        self.redis = None
        self.redis_url = config.redis_url
        self.api_key = ""
        self.base_url = ""
        self.controller_address = ""

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "logs").mkdir(exist_ok=True)
        try:
            if not self.redis_url:
                self.redis = start_redis(cfg.run_dir / "redis", appendonly=True)
                self.redis_url = self.redis.url
            storage = cfg.run_dir / "storage"
            controller = self._spawn("controller", "controller", {
                "REDIS_URL": self.redis_url,
                "STORAGE_ROOT": str(storage),
            })  # fmt: skip
            self.controller_address = f"127.0.0.1:{controller.port}"
            self._wait_grpc(controller, "lorafleet.v1.ControllerService")
            for i in range(cfg.trainers):
                m = self._spawn("trainer", f"trainer-{i}", {
                    "MODEL_PATH": str(cfg.model_path),
                    "NUM_SLOTS": str(cfg.slots),
                    "STORAGE_ROOT": str(storage),
                    "REPLICA_ID": f"trainer-{i}",
                    "CONTROLLER_ADDRESS": self.controller_address,
                })  # fmt: skip
                self._wait_grpc(m, "lorafleet.v1.TrainerService")
            for i in range(cfg.rollouts):
                m = self._spawn("rollout", f"rollout-{i}", {
                    "MODEL_PATH": str(cfg.model_path),
                    "REPLICA_ID": f"rollout-{i}",
                    "CONTROLLER_ADDRESS": self.controller_address,
                })  # fmt: skip
                self._wait_grpc(m, "lorafleet.v1.RolloutService")
            self._wait_replicas()
            gw = self._spawn("gateway", "gateway", {
                "CONTROLLER_ADDRESS": self.controller_address,
                "HOST": cfg.gateway_host,
            }, port=cfg.gateway_port or None)  # fmt: skip
            self.base_url = f"http://127.0.0.1:{gw.port}"
            self._wait_http(gw)
            self.api_key = self.create_api_key(cfg.tenant, "lorafleet up")
            self._write_state()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for member in reversed(self.members):
            stop_process(member.proc, grace=15)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        with contextlib.suppress(FileNotFoundError):
            (self.config.run_dir / STATE_FILE).unlink()

    # -- helpers ---------------------------------------------------------------------------
    @property
    def metrics_targets(self) -> list[str]:
        return [f"127.0.0.1:{m.metrics_port}" for m in self.members if m.metrics_port]

    @property
    def pids(self) -> list[int]:
        pids = [m.proc.pid for m in self.members]
        if self.redis is not None:
            pids.append(self.redis.proc.pid)
        return pids

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def create_api_key(self, tenant: str, label: str) -> str:
        with grpc.insecure_channel(self.controller_address) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            resp = stub.CreateApiKey(
                controller_pb2.CreateApiKeyRequest(tenant=tenant, label=label), timeout=10
            )
            return str(resp.api_key)

    def _spawn(
        self, service: str, name: str, settings: dict[str, str], port: int | None = None
    ) -> Member:
        prefix = f"LORAFLEET_{service.upper()}_"
        port = port or free_port()
        env = {f"{prefix}{k}": v for k, v in settings.items()}
        env[f"{prefix}PORT"] = str(port)
        if service == "gateway":
            metrics_port = port  # the gateway serves /metrics on its HTTP port
        else:
            metrics_port = free_port()
            env[f"{prefix}METRICS_PORT"] = str(metrics_port)
        env.update(self.config.extra_env.get(service, {}))
        log = self.config.run_dir / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"lorafleet_{service}"],
                env=child_env(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal goes to `lorafleet up` only
            )
        member = Member(service, name, proc, port, metrics_port, log)
        self.members.append(member)
        return member

    def _deadline(self) -> float:
        return time.monotonic() + self.config.start_timeout

    def _died(self, member: Member) -> FleetError:
        tail = member.log.read_text(errors="replace").strip().splitlines()[-5:]
        detail = " | ".join(tail) if tail else "no output"
        return FleetError(
            f"{member.name} exited with {member.proc.returncode} during start-up: {detail} "
            f"(log: {member.log})"
        )

    def _wait_grpc(self, member: Member, service: str) -> None:
        deadline = self._deadline()
        with grpc.insecure_channel(f"127.0.0.1:{member.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if member.proc.poll() is not None:
                    raise self._died(member)
                with contextlib.suppress(grpc.RpcError):
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.1)
        raise FleetError(f"{member.name} not healthy after {self.config.start_timeout:.0f}s "
                         f"(log: {member.log})")  # fmt: skip

    def _wait_replicas(self) -> None:
        """The controller must know every trainer and rollout before the gateway opens."""
        want = self.config.trainers + self.config.rollouts
        deadline = self._deadline()
        with grpc.insecure_channel(self.controller_address) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):
                    status = stub.GetFleetStatus(controller_pb2.GetFleetStatusRequest(), timeout=5)
                    if sum(1 for r in status.replicas if r.healthy) >= want:
                        return
                for m in self.members:
                    if m.proc.poll() is not None:
                        raise self._died(m)
                time.sleep(0.1)
        raise FleetError("replicas did not register with the controller in time")

    def _wait_http(self, member: Member) -> None:
        deadline = self._deadline()
        url = f"http://127.0.0.1:{member.port}/api/v1/healthz"
        while time.monotonic() < deadline:
            if member.proc.poll() is not None:
                raise self._died(member)
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(url, timeout=1) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise FleetError(f"gateway not healthy after {self.config.start_timeout:.0f}s")

    def _write_state(self) -> None:
        state = {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "controller_address": self.controller_address,
            "redis_url": self.redis_url,
            "launcher_pid": os.getpid(),
            "processes": [
                {"name": m.name, "service": m.service, "pid": m.proc.pid, "port": m.port,
                 "metrics_port": m.metrics_port, "log": str(m.log)}
                for m in self.members
            ]
            + ([{"name": "redis", "service": "redis", "pid": self.redis.proc.pid,
                 "port": self.redis.port, "metrics_port": 0, "log": ""}]
               if self.redis is not None else []),
        }  # fmt: skip
        path = self.config.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)
