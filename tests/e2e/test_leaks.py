"""Nothing leaks a trainer slot (issue 26): an abandoned tinker 0.24.1 client (it never calls
finish) gives its slot back once its session has been silent for the session timeout, while a
live client, heartbeating every 10 s, keeps its run through the same time and trains on.

(A revoked key's sessions: services/controller/tests/test_servicer.py; a finished managed
job's slot: tests/e2e/test_jobs.py.)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorafleet.testing import child_env, wait_until
from lorafleet.v1 import controller_pb2, controller_pb2_grpc

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
# Above the SDK's 10 s heartbeat interval (a live client must never hit it), short enough
# for CI; the default is 120 s (README, ControllerSettings).
TIMEOUT = 25.0
HEARTBEAT = 10.0  # tinker's session heartbeat interval (tinker-api.md §2)


def bound_runs(fleet: Any) -> set[str]:
    with fleet.admin_channel() as ch:
        status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
            controller_pb2.GetFleetStatusRequest(), timeout=60
        )
    return {reg.registration_id for rep in status.replicas for reg in rep.slots}


def session_finished(fleet: Any, model_id: str) -> bool:
    with fleet.admin_channel() as ch:
        reply = controller_pb2_grpc.ControllerServiceStub(ch).GetSession(
            controller_pb2.GetSessionRequest(
                tenant=fleet.config.tenant, session_id=model_id.split(":train:")[0]
            ),
            timeout=60,
        )
    return bool(reply.session.finished)


def start_client(python: Path, fleet: Any, base_model: str) -> subprocess.Popen:
    env = child_env(
        TINKER_BASE_URL=fleet.base_url, TINKER_API_KEY=fleet.api_key, SMOKE_BASE_MODEL=base_model
    )
    return subprocess.Popen(
        [str(python), str(HERE / "session_client_script.py")],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def ready(proc: subprocess.Popen) -> str:
    """The client's model id, once it trained its first step (its output up to then if not)."""
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:  # blocks on the client itself; it exits on any failure
        if line.startswith("READY "):
            return line.split()[1]
        seen.append(line)
    raise AssertionError("the client exited before READY:\n" + "".join(seen[-40:]))


def test_an_abandoned_0241_client_gives_its_slot_back_within_the_timeout(
    make_fleet, sdk_python
) -> None:
    python = sdk_python("0.24.1")
    env = {"controller": {"LORAFLEET_CONTROLLER_SESSION_TIMEOUT_SECONDS": str(TIMEOUT)}}
    with make_fleet(slots=2, extra_env=env) as fleet:
        caps = httpx.get(
            f"{fleet.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": fleet.api_key},
            timeout=60,
        ).json()
        base = caps["supported_models"][0]["model_name"]
        live, gone = start_client(python, fleet, base), start_client(python, fleet, base)
        try:
            live_id, gone_id = ready(live), ready(gone)
            assert {live_id, gone_id} <= bound_runs(fleet)
            gone.kill()  # abandoned: no finish, no more heartbeats
            gone.wait()
            killed_at = time.monotonic()
            wait_until(
                lambda: gone_id not in bound_runs(fleet),
                "the abandoned client's slot given back",
                within=TIMEOUT + 300,
            )
            freed_after = time.monotonic() - killed_at
            print(
                f"abandoned client's slot freed {freed_after:.1f}s after it was killed "
                f"(timeout {TIMEOUT:g}s)"
            )
            assert session_finished(fleet, gone_id)
            # by the timeout, not by anything sooner: its last heartbeat was at most one
            # interval before the kill
            assert freed_after >= TIMEOUT - HEARTBEAT - 1.0
            # the live client's session is as old and was never finished: it heartbeated
            assert live_id in bound_runs(fleet) and not session_finished(fleet, live_id)
            assert live.stdin is not None and live.stdout is not None
            live.stdin.write("go\n")
            live.stdin.flush()
            rest = live.stdout.read()
            assert live.wait(timeout=300) == 0 and "STILL GOOD" in rest, rest[-3000:]
        finally:
            for proc in (live, gone):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
