"""`lorafleet up` supervises what it started: a killed process comes back (same ports, new
PID, logged, counted in `status`), Redis included; a process past its restart budget stays
down and is reported (status, the controller's replica table, Unavailable to the SDK: to new
calls and to the calls already waiting for it) while the rest of the fleet keeps running;
`down` stops every process, restarted ones too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.testing import child_env, wait_until
from lorafleet.v1 import controller_pb2, controller_pb2_grpc
from lorafleet_cli.status import render_status
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store.keys import Keys

LORAFLEET = [sys.executable, "-m", "lorafleet_cli.main"]
SERVICE = {
    "controller": "lorafleet.v1.ControllerService",
    "trainer-0": "lorafleet.v1.TrainerService",
}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _serving(fleet: object, name: str) -> bool:
    port = fleet.member(name).port  # type: ignore[attr-defined]
    try:
        with fleet.admin_channel(f"127.0.0.1:{port}") as ch:  # type: ignore[attr-defined]
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE[name]), timeout=2
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _trainer_registered(fleet: object) -> bool:
    try:
        with fleet.admin_channel() as ch:  # type: ignore[attr-defined]
            status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
                controller_pb2.GetFleetStatusRequest(), timeout=5
            )
    except grpc.RpcError:
        return False
    return any(r.replica_id == "trainer-0" and r.healthy for r in status.replicas)


def _gateway_answers(fleet: object) -> bool:
    try:
        reply = httpx.get(
            f"{fleet.base_url}/api/v1/get_server_capabilities",  # type: ignore[attr-defined]
            headers={"X-API-Key": fleet.api_key},
            timeout=10,
        )  # type: ignore[attr-defined]
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _kill(fleet: object, name: str) -> int:
    member = fleet.member(name)  # type: ignore[attr-defined]
    pid = member.proc.pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: member.proc.pid != pid, f"{name} restarted")
    return pid


def _trainer_down(fleet: object) -> bool:
    with fleet.admin_channel() as ch:  # type: ignore[attr-defined]
        status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
            controller_pb2.GetFleetStatusRequest(), timeout=10
        )
    return any(r.replica_id == "trainer-0" and not r.healthy for r in status.replicas)


def _open_operations(fleet: object, run: str) -> int:
    """The run's open operations, from its registration record in the fleet's Redis."""
    client = redis.Redis.from_url(fleet.redis_url)  # type: ignore[attr-defined]
    try:
        defaults = ControllerSettings()  # the key prefix and groups `lorafleet up` runs with
        keys = Keys(defaults.key_prefix, defaults.ledger_groups)
        return int(client.hget(keys.reg(run), "pending") or 0)
    finally:
        client.close()


def _model_name(fleet: object) -> str:
    caps = httpx.get(
        f"{fleet.base_url}/api/v1/get_server_capabilities",  # type: ignore[attr-defined]
        headers={"X-API-Key": fleet.api_key},
        timeout=30,
    ).json()  # type: ignore[attr-defined]
    return str(caps["supported_models"][0]["model_name"])


def _sdk_create(fleet: object, python: Path, model: str) -> dict:
    """create_model through the real SDK's client (degraded_sdk_script.py)."""
    env = child_env(
        TINKER_BASE_URL=fleet.base_url,
        TINKER_API_KEY=fleet.api_key,  # type: ignore[attr-defined]
        SMOKE_BASE_MODEL=model,
    )
    proc = subprocess.run(
        [str(python), str(Path(__file__).with_name("degraded_sdk_script.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DEGRADED ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("DEGRADED ") :])


def _line(proc: subprocess.Popen[str], prefix: str) -> str:
    """The client's next line, which must start with `prefix` (its output so far if not)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        proc.kill()
        raise AssertionError(line + proc.communicate(timeout=60)[1][-6000:])
    return line[len(prefix) :].strip()


def _sdk_client(fleet: object, python: Path, model: str) -> tuple[subprocess.Popen[str], str]:
    """A real SDK client (waiting_sdk_script.py) that holds a training run, and the run."""
    env = child_env(
        TINKER_BASE_URL=fleet.base_url,
        TINKER_API_KEY=fleet.api_key,  # type: ignore[attr-defined]
        SMOKE_BASE_MODEL=model,
    )
    script = str(Path(__file__).with_name("waiting_sdk_script.py"))
    proc = subprocess.Popen(
        [str(python), script],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, _line(proc, "READY ")


def test_killed_processes_come_back_and_a_spent_budget_degrades_the_fleet(
    make_fleet, sdk_python
) -> None:
    python = sdk_python("0.38.0")
    with make_fleet(slots=2, backoff_initial=0.2) as fleet:
        old = [_kill(fleet, "trainer-0")]
        wait_until(lambda: _serving(fleet, "trainer-0"), "trainer-0 SERVING again")
        wait_until(lambda: _trainer_registered(fleet), "trainer-0 registered again")

        old.append(_kill(fleet, "controller"))
        wait_until(lambda: _serving(fleet, "controller"), "controller SERVING again")
        wait_until(lambda: _gateway_answers(fleet), "the gateway answers through it")

        old.append(_kill(fleet, "redis"))
        wait_until(lambda: _gateway_answers(fleet), "the key still works after Redis restarts")

        state = json.loads((fleet.config.run_dir / "fleet.json").read_text())
        restarts = {p["name"]: p["restarts"] for p in state["processes"]}
        assert restarts == {
            "controller": 1,
            "trainer-0": 1,
            "rollout-0": 0,
            "gateway": 0,
            "redis": 1,
        }
        assert {p["pid"] for p in state["processes"]} == set(fleet.pids)
        log = (fleet.config.run_dir / "logs" / "supervisor.log").read_text()
        for name in ("trainer-0", "controller", "redis"):
            assert f"{name} exited with -9" in log and f"{name} restarted as PID" in log

        fleet.config.restart_budget = 1  # rollout-0 may come back once more, not twice
        _kill(fleet, "rollout-0")
        rollout = fleet.member("rollout-0")
        wait_until(lambda: rollout.proc.poll() is None, "rollout-0 restarted")
        os.kill(rollout.proc.pid, signal.SIGKILL)
        wait_until(lambda: "rollout-0" in fleet.failures, "supervision gives up on rollout-0")
        assert fleet.failures["rollout-0"].startswith("rollout-0 exited with -9 after 1 restarts")
        # trainer-0 spent its one restart above: killed again, it stays down too.
        model = _model_name(fleet)  # while a trainer serves it (capabilities list live ones)
        waiting, run = _sdk_client(fleet, python, model)
        report, _ = render_status(fleet.controller_address, fleet.admin, None)
        holders = {
            ln.split()[2]: ln.split() for ln in report.splitlines() if ln.startswith("trainer-0 ")
        }
        # who holds the slot, and since when ("10:04:15 (3s)")
        assert holders[run][3] == "local" and holders[run][5].endswith("s)"), report
        trainer = fleet.member("trainer-0")
        os.kill(trainer.proc.pid, signal.SIGSTOP)  # the client's next call waits on it
        assert waiting.stdin is not None
        waiting.stdin.write("go\n")
        waiting.stdin.flush()
        _line(waiting, "WAITING")
        # The SDK prints WAITING once it has queued the call, not once the fleet admitted it:
        # kill the trainer only when the operation is open, or on a loaded machine the call
        # arrives after the trainer failed for good and is refused at submission (503, which
        # the SDK retries) instead of failing while it waits, which is what this checks.
        wait_until(lambda: _open_operations(fleet, run) > 0, "the waiting call admitted")
        os.kill(trainer.proc.pid, signal.SIGKILL)
        wait_until(lambda: "trainer-0" in fleet.failures, "supervision gives up on trainer-0")
        failed_at = time.time()
        wait_until(lambda: _trainer_down(fleet), "the controller's replica table: trainer-0 down")

        # The call that waited on it ends with Unavailable naming the trainer and why.
        out, err = waiting.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("WAITED ")]
        assert lines, out[-3000:] + err[-6000:]
        waited = json.loads(lines[-1][len("WAITED ") :])
        print(
            f"the waiting call failed {waited['at'] - failed_at:.2f}s after supervision "
            "gave up on trainer-0"
        )
        assert waited["type"] == "RequestFailedError", waited
        assert waited["at"] - failed_at < 5, waited
        assert "no healthy trainer serves base model" in waited["message"], waited
        assert "trainer-0 (failed: trainer-0 exited with -9" in waited["message"], waited

        answer = _sdk_create(fleet, python, model)
        assert answer["status"] == 503 and answer["seconds"] < 5, answer
        assert "no healthy trainer serves base model" in answer["message"], answer
        assert "trainer-0" in answer["message"], answer

        # The rest of the fleet keeps running and the failed ones stay down.
        assert _serving(fleet, "controller") and _gateway_answers(fleet)
        assert fleet.failures.keys() == {"rollout-0", "trainer-0"}
        assert trainer.proc.poll() is not None and rollout.proc.poll() is not None
        alive = {m.name for m in fleet.supervised if m.proc.poll() is None}
        assert alive == {"redis", "controller", "gateway"}, alive

        state = json.loads((fleet.config.run_dir / "fleet.json").read_text())
        report, problem = render_status(fleet.controller_address, fleet.admin, state)
        assert problem == "", problem
        # The controller's replica table and the runs left without a trainer, with reasons.
        assert "Replicas down for good (the controller's replica table):" in report, report
        assert "  trainer-0: trainer-0 exited with -9 after 1 restarts" in report, report
        runs = {
            ln.split()[0]: ln for ln in report.split("Runs not bound or queued")[1].splitlines()[3:]
        }
        assert " UNAVAILABLE " in runs[run] and "trainer-0" in runs[run], report
        processes = report.split("Trainer slots")[0].splitlines()
        rows = {ln.split()[0]: ln.split() for ln in processes if ln.strip()}
        assert rows["trainer-0"][4] == "FAILED" and rows["rollout-0"][4] == "FAILED", report
        assert rows["gateway"][4] == "SERVING", report
        for name in ("trainer-0", "rollout-0"):
            log = fleet.member(name).log
            assert f"  {name}: {name} exited with -9 after 1 restarts" in report, report
            assert f"it stays down; log: {log}" in report, report
        current = fleet.pids
    assert [p for p in [*old, *current] if _alive(p)] == []


def _run(args: list[str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LORAFLEET_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [*LORAFLEET, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _processes(run_dir: Path) -> dict[str, dict]:
    state = json.loads((run_dir / "fleet.json").read_text())
    return {p["name"]: p for p in state["processes"]}


def test_up_restarts_status_counts_and_down_stops_the_restarted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    up = _run(
        [
            "up",
            "--detach",
            "--model",
            str(tiny_model_dir),
            "--slots",
            "2",
            "--run-dir",
            str(run_dir),
        ],
        tmp_path,
    )
    assert up.returncode == 0, up.stderr
    launcher = json.loads((run_dir / "fleet.json").read_text())["launcher_pid"]
    first = _processes(run_dir)
    pids = {p["pid"] for p in first.values()} | {launcher}
    try:
        os.kill(first["trainer-0"]["pid"], signal.SIGKILL)
        wait_until(lambda: _processes(run_dir)["trainer-0"]["restarts"] == 1, "a restart")
        pids.add(_processes(run_dir)["trainer-0"]["pid"])

        def trainer_row() -> list[str]:
            status = _run(["status"], tmp_path, timeout=120)
            rows = [line.split() for line in status.stdout.splitlines()]
            return next(row for row in rows if row and row[0] == "trainer-0")

        wait_until(lambda: trainer_row()[3:] == ["1", "SERVING"], "status: 1 restart, SERVING")

        redis_pid = first["redis"]["pid"]
        os.kill(redis_pid, signal.SIGSTOP)  # Redis hangs: the process table still prints
        try:
            status = _run(["status"], tmp_path, timeout=120)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        rows = {line.split()[0]: line.split() for line in status.stdout.splitlines() if line}
        assert rows["redis"][3:] == ["0", "DOWN", "(TimeoutError)"], status.stdout
        assert rows["gateway"][4] == "SERVING", status.stdout
        assert up.stdout.split("TINKER_API_KEY=")[1].strip() not in status.stdout
    finally:
        pids |= {p["pid"] for p in _processes(run_dir).values()}
        down = _run(["down"], tmp_path, timeout=120)
    assert down.returncode == 0, down.stderr
    wait_until(lambda: not any(_alive(p) for p in pids), "every process stopped")
