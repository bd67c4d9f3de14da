"""Bring up the whole fleet on loopback as real processes, and take it down again.

Used by `lorafleet up` and by every end-to-end test, so the tests exercise exactly what a
user runs. Order: Redis (private, with a generated password, unless a URL is given) →
controller → trainers → rollouts → gateway; each must report healthy before the next
starts. Every process is recorded by PID in `<run_dir>/fleet.json` and stopped by that PID,
never by name.

Internal gRPC is mutual TLS: the fleet makes a private CA for the run (`ca.py`), gives each
process its own certificate through LORAFLEET_TLS_* (its role, and for trainers and
rollouts its replica: `trainer/trainer-0` registers as trainer-0 only; `lorafleet.rpc.roles`),
and keeps an admin certificate for itself and the CLI (minting keys, fleet status).

`engine="sglang"` starts a real SGLang server beside each rollout (`sglang-<i>`, launched by
`lorafleet_rollout.sglang_server`: its CPU backend with our shims here, CUDA where an NVIDIA
driver is) and points that rollout's SGLang engine at it. The servers start first, since
they take longest, and each must be healthy before its rollout starts.

Supervision: a thread restarts any process that exits (the private Redis included) with
the same settings and ports, after an exponential backoff, at most `restart_budget` times
per process within `restart_window` seconds. Past that budget the process stays down and is
marked failed (`Member.failed`, the reason, written to fleet.json with its log path): the
fleet degrades, it does not vanish. The rest keeps running, `status` names the failed
process, and the controller, told so (ReportReplicaFailed), answers calls that need it
with Unavailable naming it, the calls already waiting for it included. Each restart is
logged and rewrites fleet.json with the new PID and the restart count, so `status` shows
it and `down` stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet import quantize
from lorafleet.rpc.channel import make_blocking_channel
from lorafleet.rpc.roles import Role, common_name
from lorafleet.settings import TlsSettings
from lorafleet.testing import RedisServer, child_env, free_port, start_redis, stop_process
from lorafleet.tls import TlsIdentity, identity_from_settings
from lorafleet.v1 import controller_pb2, controller_pb2_grpc
from lorafleet_cli.ca import ADMIN_NAME, CertFiles, make_run_ca, write_private

if TYPE_CHECKING:
    from lorafleet_rollout.sglang_server import SGLangServer

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
    # Rollout engine: "torch" (in the rollout process) or "sglang" (a server beside each).
    engine: str = "torch"
    # sglang: the interpreter with SGLang installed (default: the repo's .venvs/sglang).
    sglang_python: Path | None = None
    # How every trainer, rollout and SGLang server stores the base (lorafleet.quantize).
    quantization: str = quantize.NONE
    # Extra environment per service ("controller", "trainer", "rollout", "gateway"), then
    # per process name ("trainer-1": one replica set apart, as the fault campaign's canary).
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    start_timeout: float = 180.0
    # Supervision: restart a process that exits, waiting backoff_initial, doubling up to
    # backoff_max; a process that ran backoff_reset seconds starts again from the initial
    # wait. More than restart_budget restarts of one process within restart_window fails
    # the fleet instead.
    supervise: bool = True
    restart_budget: int = 5
    restart_window: float = 600.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    backoff_reset: float = 60.0


@dataclass
class Member:
    service: str
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # empty: `python -m lorafleet_<service>`
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    recent_restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None  # a restart is scheduled for this monotonic time
    backoff: float = 0.0
    failed: str = ""  # why supervision gave up on it ("": it is supervised)


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.members: list[Member] = []
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url
        self.api_key = ""
        self.base_url = ""
        self.controller_address = ""
        self.certs: dict[str, CertFiles] = {}
        self.admin: TlsIdentity | None = None
        self.redis_member: Member | None = None  # the private Redis, when we started it
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._supervisor: threading.Thread | None = None

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
        cfg.run_dir.chmod(0o700)  # keys, certificates and tenants' checkpoints live here
        (cfg.run_dir / "logs").mkdir(exist_ok=True)
        try:
            self.certs = make_run_ca(cfg.run_dir / "tls", self._common_names())
            admin = self.certs[ADMIN_NAME]
            self.admin = identity_from_settings(
                TlsSettings(admin.ca_file, admin.cert_file, admin.key_file)
            )
            if not self.redis_url:
                # Loopback is every local user's: the private Redis wants a password too.
                self.redis = start_redis(
                    cfg.run_dir / "redis", appendonly=True, password=secrets.token_urlsafe(24)
                )
                self.redis_url = self.redis.url
                self.redis_member = Member(
                    "redis",
                    "redis",
                    self.redis.proc,
                    self.redis.port,
                    0,
                    self.redis.data_dir / "redis.log",
                )
            engines = self._start_engines()
            storage = cfg.run_dir / "storage"
            # One machine: every process sees the same folder, so a publish goes by reference
            # (the trainer writes, rollouts read; lorafleet.shared_storage).
            shared = str((cfg.run_dir / "shared-adapters").resolve())
            controller = self._spawn(
                "controller",
                "controller",
                {
                    "REDIS_URL": self.redis_url,
                    "STORAGE_ROOT": str(storage),
                    "SHARED_ADAPTER_ROOT": shared,
                },
            )
            self.controller_address = f"127.0.0.1:{controller.port}"
            self._wait_grpc(controller, "lorafleet.v1.ControllerService")
            for i in range(cfg.trainers):
                m = self._spawn(
                    "trainer",
                    f"trainer-{i}",
                    {
                        "MODEL_PATH": str(cfg.model_path),
                        "NUM_SLOTS": str(cfg.slots),
                        "STORAGE_ROOT": str(storage),
                        "SHARED_ADAPTER_ROOT": shared,
                        "REPLICA_ID": f"trainer-{i}",
                        "CONTROLLER_ADDRESS": self.controller_address,
                        "QUANTIZATION": cfg.quantization,
                    },
                )
                self._wait_grpc(m, "lorafleet.v1.TrainerService")
            for i in range(cfg.rollouts):
                m = self._spawn(
                    "rollout",
                    f"rollout-{i}",
                    {
                        "MODEL_PATH": str(cfg.model_path),
                        "SHARED_ADAPTER_ROOT": shared,
                        "REPLICA_ID": f"rollout-{i}",
                        "CONTROLLER_ADDRESS": self.controller_address,
                        "QUANTIZATION": cfg.quantization,
                        **self._engine_settings(i, engines),
                    },
                )
                self._wait_grpc(m, "lorafleet.v1.RolloutService")
            self._wait_replicas()
            gw = self._spawn(
                "gateway",
                "gateway",
                {
                    "CONTROLLER_ADDRESS": self.controller_address,
                    "HOST": cfg.gateway_host,
                },
                port=cfg.gateway_port or None,
            )
            self.base_url = f"http://127.0.0.1:{gw.port}"
            self._wait_http(gw)
            self.api_key = self.create_api_key(cfg.tenant, "lorafleet up")
            self._write_state()
        except BaseException:
            self.stop()
            raise
        if cfg.supervise:
            self._supervisor = threading.Thread(
                target=self._supervise, name="fleet-supervisor", daemon=True
            )
            self._supervisor.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        with self._lock:
            for member in reversed(self.members):
                if member.service == "sglang":
                    from lorafleet_rollout.sglang_server import stop

                    stop(member.proc, grace=15)
                else:
                    stop_process(member.proc, grace=15)
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
        with contextlib.suppress(FileNotFoundError):
            (self.config.run_dir / STATE_FILE).unlink()

    def _common_names(self) -> list[str]:
        """One certificate per process: the controller's and gateway's by role, each
        trainer's and rollout's bound to its replica id."""
        replicas = [
            common_name(Role(service), f"{service}-{i}")
            for service, count in (
                ("trainer", self.config.trainers),
                ("rollout", self.config.rollouts),
            )
            for i in range(count)
        ]
        return [common_name(Role.CONTROLLER), common_name(Role.GATEWAY), *replicas]

    def client_env(self, name: str) -> dict[str, str]:
        """LORAFLEET_TLS_* of process `name`'s certificate, for it or for one more process
        acting as it (a test's second gateway, say)."""
        return self.certs[name].env()

    # -- supervision -----------------------------------------------------------------------
    def _note(self, message: str) -> None:
        """One line on stderr (the `lorafleet up` log) and in logs/supervisor.log."""
        line = f"lorafleet: {message}"
        print(line, file=sys.stderr, flush=True)
        with open(self.config.run_dir / "logs" / "supervisor.log", "a") as out:
            out.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                if self._stopping.is_set():
                    return
                for member in self.supervised:
                    if not member.failed and member.proc.poll() is not None:
                        self._schedule_or_restart(member)

    @property
    def failures(self) -> dict[str, str]:
        """Process name -> why supervision gave up on it (its restart budget is spent)."""
        with self._lock:
            return {m.name: m.failed for m in self.supervised if m.failed}

    @property
    def supervised(self) -> list[Member]:
        return [*([self.redis_member] if self.redis_member else []), *self.members]

    def _schedule_or_restart(self, member: Member) -> None:
        now = time.monotonic()
        code = member.proc.returncode
        if member.restart_at is None:
            member.recent_restarts = [
                t for t in member.recent_restarts if now - t < self.config.restart_window
            ]
            if len(member.recent_restarts) >= self.config.restart_budget:
                member.failed = (
                    f"{member.name} exited with {code} after {len(member.recent_restarts)} "
                    f"restarts in {self.config.restart_window:.0f}s; it stays down"
                )
                self._note(f"{member.failed} (log: {member.log}); the rest of the fleet runs")
                self._write_state()
                threading.Thread(
                    target=self._report_failed,
                    args=(member,),
                    daemon=True,
                    name=f"report-{member.name}",
                ).start()
                return
            ran = now - member.started_at
            if ran >= self.config.backoff_reset or member.backoff == 0:
                member.backoff = self.config.backoff_initial
            else:
                member.backoff = min(member.backoff * 2, self.config.backoff_max)
            member.restart_at = now + member.backoff
            self._note(
                f"{member.name} exited with {code} after {ran:.1f}s; restarting in "
                f"{member.backoff:.1f}s (restart {len(member.recent_restarts) + 1} "
                f"of {self.config.restart_budget} within "
                f"{self.config.restart_window:.0f}s)"
            )
        elif now >= member.restart_at:
            member.restart_at = None
            member.recent_restarts.append(now)
            member.restarts += 1
            member.started_at = now
            try:
                if member.service == "redis":
                    self._restart_redis(member)
                else:
                    self._respawn(member)
            except Exception as exc:  # a failed start counts as one more crash
                self._note(f"{member.name} did not start again: {exc}")
            self._write_state()

    def _report_failed(self, member: Member) -> None:
        """Tell the controller that a trainer or rollout stays down. Silence alone would say
        only that the replica is gone, which a restart undoes, so runs waiting for it would
        wait for ever; told, the controller fails their waiting calls with Unavailable naming
        it (and its reason) and shows the reason in its replica table."""
        replica_id = member.env.get(f"LORAFLEET_{member.service.upper()}_REPLICA_ID")
        if not replica_id:
            return
        try:
            with self.admin_channel() as ch:
                controller_pb2_grpc.ControllerServiceStub(ch).ReportReplicaFailed(
                    controller_pb2.ReportReplicaFailedRequest(
                        replica_id=replica_id, reason=f"{member.failed}; log: {member.log}"
                    ),
                    timeout=10,
                )
        except grpc.RpcError as exc:
            self._note(
                f"could not tell the controller that {replica_id} failed: "
                f"{exc.code().name} {exc.details()}"
            )

    def _respawn(self, member: Member) -> None:
        with open(member.log, "ab") as out:
            member.proc = subprocess.Popen(
                member.argv or [sys.executable, "-m", f"lorafleet_{member.service}"],
                env=member.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._note(f"{member.name} restarted as PID {member.proc.pid}")

    def _restart_redis(self, member: Member) -> None:
        """Same port and folder: the append-only file brings every acknowledged write back."""
        assert self.redis is not None
        self.redis = start_redis(
            self.redis.data_dir,
            port=self.redis.port,
            appendonly=True,
            password=self.redis.password,
        )
        member.proc = self.redis.proc
        self._note(f"redis restarted as PID {member.proc.pid}")

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
        return next(m for m in self.supervised if m.name == name)

    def admin_channel(self, address: str = "") -> grpc.Channel:
        """A channel that presents the run's admin certificate (to the controller unless
        `address` names another member)."""
        return make_blocking_channel(address or self.controller_address, tls=self.admin)

    def create_api_key(self, tenant: str, label: str) -> str:
        with self.admin_channel() as ch:
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
        env.update(self.client_env(name))
        env[f"{prefix}PORT"] = str(port)
        metrics_port = free_port()
        env[f"{prefix}METRICS_PORT"] = str(metrics_port)
        env.update(self.config.extra_env.get(service, {}))
        env.update(self.config.extra_env.get(name, {}))
        log = self.config.run_dir / "logs" / f"{name}.log"
        env = child_env(**env)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"lorafleet_{service}"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal goes to `lorafleet up` only
            )
        member = Member(service, name, proc, port, metrics_port, log, env)
        self.members.append(member)
        return member

    def _start_engines(self) -> list[tuple[SGLangServer, Member]]:
        """engine="sglang": one SGLang server per rollout, all started now, waited for by
        `_engine_settings` just before their rollout starts."""
        if self.config.engine != "sglang":
            return []
        from lorafleet_rollout.sglang_server import DEFAULT_PYTHON, SGLangServer, default_device

        engines = []
        for i in range(self.config.rollouts):
            server = SGLangServer(
                self.config.model_path.resolve(),
                free_port(),
                python=self.config.sglang_python or DEFAULT_PYTHON,
                device=default_device(),
                quantization=self.config.quantization,
            )
            try:
                server.check()
            except (FileNotFoundError, ValueError) as exc:  # ValueError: what it cannot serve
                raise FleetError(str(exc)) from None
            name = f"sglang-{i}"
            log = self.config.run_dir / "logs" / f"{name}.log"
            proc = server.start(log)
            member = Member(
                "sglang", name, proc, server.port, 0, log, server.env(), server.command()
            )
            self.members.append(member)
            engines.append((server, member))
        return engines

    def _engine_settings(
        self, i: int, engines: list[tuple[SGLangServer, Member]]
    ) -> dict[str, str]:
        """The rollout's engine settings; for SGLang, once its server answers /health."""
        if not engines:
            return {}
        server, member = engines[i]
        try:
            server.wait_healthy(member.proc, member.log, self.config.start_timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise FleetError(f"{member.name}: {exc} (log: {member.log})") from None
        adapters = (self.config.run_dir / f"rollout-{i}-adapters").resolve()
        return {
            "ENGINE": "sglang",
            "ENGINE_URL": server.url,
            "MAX_LORA_RANK": str(server.max_lora_rank),
            "MAX_LOADED_ADAPTERS": str(server.max_loaded_loras),
            "ADAPTER_DIR": str(adapters),  # the server reads adapters by this absolute path
        }

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
        with self.admin_channel(f"127.0.0.1:{member.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if member.proc.poll() is not None:
                    raise self._died(member)
                with contextlib.suppress(grpc.RpcError):
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.1)
        raise FleetError(
            f"{member.name} not healthy after {self.config.start_timeout:.0f}s (log: {member.log})"
        )

    def _wait_replicas(self) -> None:
        """The controller must know every trainer and rollout before the gateway opens."""
        want = self.config.trainers + self.config.rollouts
        deadline = self._deadline()
        with self.admin_channel() as ch:
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
        admin = self.certs.get(ADMIN_NAME)
        state = {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "controller_address": self.controller_address,
            "redis_url": self.redis_url,
            "launcher_pid": os.getpid(),
            "admin_tls": {k: str(v) for k, v in admin.env().items()} if admin else {},
            "processes": [
                {
                    "name": m.name,
                    "service": m.service,
                    "pid": m.proc.pid,
                    "port": m.port,
                    "metrics_port": m.metrics_port,
                    "log": str(m.log),
                    "restarts": m.restarts,
                    "failed": m.failed,
                }
                for m in [*self.members, *([self.redis_member] if self.redis_member else [])]
            ],
        }
        path = self.config.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        write_private(tmp, json.dumps(state, indent=2).encode())
        tmp.replace(path)
