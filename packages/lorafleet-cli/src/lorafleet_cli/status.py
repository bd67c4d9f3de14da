"""`lorafleet status`: the fleet as a readable table (processes, slots, queues, adapters).

The process table comes from fleet.json and each process's own health check, so it is
printed even when Redis or the controller is down: that is when an operator needs it. The
rest comes from the controller's GetFleetStatus: who holds each trainer slot and since when,
who waits for one, and the runs that need an eye (unavailable, paged, corrupted, failed),
each with its state as the registry records it and its reason.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet import contract
from lorafleet.rpc.channel import make_blocking_channel
from lorafleet.tls import TlsIdentity, identity_from_env
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

_SERVICE = {
    "controller": "lorafleet.v1.ControllerService",
    "trainer": "lorafleet.v1.TrainerService",
    "rollout": "lorafleet.v1.RolloutService",
}


def _health(port: int, service: str, tls: TlsIdentity | None) -> str:
    try:
        with make_blocking_channel(f"127.0.0.1:{port}", tls=tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    except grpc.RpcError as exc:
        return f"DOWN ({exc.code().name})"


def _http_health(port: int, path: str = "/api/v1/healthz") -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return "SERVING" if r.status == 200 else f"HTTP {r.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"DOWN ({exc.__class__.__name__})"


def _redis_health(port: int) -> str:
    """PING answered: PONG, or NOAUTH from the private Redis, which wants its password (the
    server answers; whether the controller gets in is the controller's health)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"PING\r\n")
            reply = conn.recv(16)
            return "SERVING" if reply.startswith((b"+PONG", b"-NOAUTH")) else "NOT_SERVING"
    except OSError as exc:
        return f"DOWN ({exc.__class__.__name__})"


def _process_health(service: str, port: int, tls: TlsIdentity | None) -> str:
    if service in _SERVICE:
        return _health(port, _SERVICE[service], tls)
    if service == "sglang":  # the server beside a rollout (lorafleet up --engine sglang)
        from lorafleet_rollout.sglang_api import HEALTH

        return _http_health(port, HEALTH)
    return _http_health(port) if service == "gateway" else _redis_health(port)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


# A rollout holds hundreds of versions: the table names a few, and says how many more.
ADAPTERS_NAMED = 4


def _some(ids: Sequence[str]) -> str:
    if not ids:
        return "(none)"
    shown = ", ".join(sorted(ids)[:ADAPTERS_NAMED])
    return shown if len(ids) <= ADAPTERS_NAMED else f"{shown} (+{len(ids) - ADAPTERS_NAMED} more)"


def _ago(ts: float) -> str:
    return f"{time.time() - ts:.0f}s ago" if ts else "-"


def _since(ts: float) -> str:
    """When a slot was taken, and how long ago (slots are held for hours, not seconds)."""
    if not ts:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f" ({_ago(ts).removesuffix(' ago')})"


def run_state(reg: controller_pb2.Registration) -> str:
    """The state's proto name, whatever it is (a state added later shows as it is named),
    marked when a retired run was corrupted or failed."""
    name = controller_pb2.RegistrationState.Name(reg.state).removeprefix("REGISTRATION_STATE_")
    return name + ("/corrupted" if reg.corrupted else "/failed" if reg.failed else "")


def run_reason(reg: controller_pb2.Registration) -> str:
    """Why it is shown: what its lost trainer took, the trainer's refusal, or why it waits."""
    if reg.corrupted:
        return reg.corrupted
    if reg.failed:
        return contract.run_failure(reg.failed).message
    return reg.unavailable_reason


def render_status(
    controller: str, tls: TlsIdentity | None, state: dict[str, Any] | None
) -> tuple[str, str]:
    """The report, and what is wrong when the controller does not answer ("" if nothing)."""
    out = []
    if state:
        rows, failed = [], []
        for p in state["processes"]:
            if p.get("failed"):  # supervision gave up on it: it stays down (fleet.py)
                health = "FAILED"
                failed.append(f"  {p['name']}: {p['failed']}; log: {p['log']}")
            else:
                health = _process_health(p["service"], p["port"], tls)
            rows.append(
                [p["name"], str(p["pid"]), str(p["port"]), str(p.get("restarts", 0)), health]
            )
        out += ["Processes", _table(["name", "pid", "port", "restarts", "health"], rows), ""]
        if failed:
            out += [
                "Failed (restart budget spent; the rest of the fleet runs without them):",
                *failed,
                "  Fix the cause in the log, then `lorafleet down` and `lorafleet up` again.",
                "",
            ]
    try:
        with make_blocking_channel(controller, tls=tls) as ch:
            status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
                controller_pb2.GetFleetStatusRequest(), timeout=10
            )
    except grpc.RpcError as exc:
        problem = f"controller at {controller} does not answer ({exc.code().name}: {exc.details()})"
        if exc.code() == grpc.StatusCode.UNAVAILABLE and (tls or identity_from_env()) is None:
            problem += "; if the fleet uses mutual TLS, set LORAFLEET_TLS_* to an admin certificate"
        return "\n".join(out).rstrip(), problem

    slot_rows, adapter_rows, down = [], [], []
    for r in status.replicas:
        if r.failed:  # its supervisor gave up on it (ReportReplicaFailed)
            down.append(f"  {r.replica_id}: {r.failed}")
        if r.kind == controller_pb2.REPLICA_KIND_TRAINER:
            bound = {reg.slot: reg for reg in r.slots}
            for slot in range(r.num_slots):
                reg = bound.get(slot)
                slot_rows.append(
                    [
                        r.replica_id,
                        str(slot),
                        reg.registration_id if reg else "(free)",
                        reg.tenant if reg else "",
                        _since(reg.bound_at) if reg else "",
                        str(reg.lora_config.rank) if reg else "",
                        str(reg.optim_steps) if reg else "",
                        reg.last_checkpoint if reg else "",
                        "" if r.healthy else "FAILED" if r.failed else "UNHEALTHY",
                    ]
                )
        else:
            health = "healthy" if r.healthy else f"unhealthy ({_ago(r.last_seen)})"
            adapter_rows.append(
                [
                    r.replica_id,
                    r.base_model,
                    str(r.homes),
                    str(len(r.adapters)),
                    f"{r.adapters_loaded}/{r.num_slots}",
                    _some(r.adapters),
                    health,
                ]
            )
    out += [
        "Trainer slots",
        _table(
            [
                "trainer",
                "slot",
                "registration",
                "tenant",
                "since",
                "rank",
                "steps",
                "last save",
                "",
            ],
            slot_rows,
        ),
        "",
    ]
    if down:
        out += ["Replicas down for good (the controller's replica table):", *down, ""]
    out += [
        "Rollout adapters (homes: runs placed there; held: versions on its disk; loaded: in"
        " its engine, of its slots)",
        _table(
            ["rollout", "base model", "homes", "held", "loaded", "adapters", "health"],
            adapter_rows,
        ),
        "",
    ]
    depth = ", ".join(f"{k}={v}" for k, v in sorted(status.ledger_depth.items())) or "empty"
    queued = (
        ", ".join(f"{q.registration_id} (#{q.queue_position})" for q in status.queued_registrations)
        or "none"
    )
    out += [f"Ledger: {depth}", f"Waiting for a slot: {queued}"]
    if status.attention_total:
        shown = len(status.attention)
        more = f", the newest {shown}" if shown < status.attention_total else ""
        rows = [
            [reg.registration_id, reg.tenant, run_state(reg), run_reason(reg)]
            for reg in status.attention
        ]
        out += [
            "",
            f"Runs not bound or queued ({status.attention_total}{more})",
            _table(["run", "tenant", "state", "reason"], rows),
        ]
    return "\n".join(out), ""
