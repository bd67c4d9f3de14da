"""`lorafleet up/status/down` as a user runs them, with real processes on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import free_port, wait_until

LORAFLEET = [sys.executable, "-m", "lorafleet_cli.main"]


def _run(args: list[str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LORAFLEET_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [*LORAFLEET, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_up_detach_status_down_leaves_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
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
    lines = up.stdout.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("export TINKER_BASE_URL=http://127.0.0.1:")
    assert lines[1].startswith("export TINKER_API_KEY=tml-")
    base_url = lines[0].split("=", 1)[1]
    api_key = lines[1].split("=", 1)[1]
    state = json.loads((run_dir / "fleet.json").read_text())
    pids = [p["pid"] for p in state["processes"]] + [state["launcher_pid"]]
    try:
        caps = httpx.get(
            f"{base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": api_key}, timeout=30
        )
        assert caps.status_code == 200
        assert caps.json()["supported_models"]

        status = _run(["status"], tmp_path, timeout=60)
        assert status.returncode == 0, status.stderr
        for word in ("trainer-0", "rollout-0", "Trainer slots", "Rollout adapters"):
            assert word in status.stdout
        health = {line.split()[0]: line.split()[-1] for line in status.stdout.splitlines()[3:8]}
        assert health == dict.fromkeys(
            ["controller", "trainer-0", "rollout-0", "gateway", "redis"], "SERVING"
        )

        # Plaintext to the controller is refused, and status says what to do about it.
        address = state["controller_address"]
        plain = _run(["status", "--controller", address], tmp_path, timeout=60)
        assert plain.returncode == 1
        assert plain.stderr.strip().startswith(f"lorafleet: controller at {address} does not")
        assert plain.stderr.strip().endswith(
            "if the fleet uses mutual TLS, set LORAFLEET_TLS_* to an admin certificate"
        )

        # Key management goes through the run's admin certificate.
        created = _run(["keys", "create", "team-a", "--label", "ci"], tmp_path, timeout=60)
        assert created.returncode == 0, created.stderr
        key_id = created.stderr.split("key ", 1)[1].split()[0]
        listed = _run(["keys", "list", "team-a"], tmp_path, timeout=60)
        assert listed.stdout.split()[:3] == [key_id, "team-a", "active"], listed.stdout
        everyone = _run(["keys", "list"], tmp_path, timeout=60)
        assert everyone.returncode == 1
        assert everyone.stderr.strip() == (
            "lorafleet: keys list needs a tenant: `lorafleet keys list TENANT`"
        )
        revoked = _run(["keys", "revoke", key_id], tmp_path, timeout=60)
        assert revoked.returncode == 0, revoked.stderr
        listed = _run(["keys", "list", "team-a"], tmp_path, timeout=60)
        assert listed.stdout.split()[2] == "revoked"
    finally:
        down = _run(["down"], tmp_path, timeout=120)
    assert down.returncode == 0, down.stderr
    wait_until(lambda: not any(_alive(p) for p in pids), "every process stopped by `down`")


def test_down_with_nothing_running(tmp_path: Path) -> None:
    down = _run(["down"], tmp_path)
    assert down.returncode == 0
    assert "nothing running" in down.stderr


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        up = _run(["up", "--port", str(port)], tmp_path)
    assert up.returncode != 0
    assert up.stderr.strip().splitlines() == [
        f"lorafleet: port {port} is already in use (pick another with --port)"
    ]


def test_up_refuses_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "nomodel").mkdir()
    up = _run(["up", "--model", str(tmp_path / "nomodel")], tmp_path)
    assert up.returncode != 0
    lines = up.stderr.strip().splitlines()
    assert len(lines) == 1 and "nomodel" in lines[0]


def test_up_refuses_a_redis_that_does_not_answer(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    up = _run(["up", "--redis-url", url], tmp_path)
    assert up.returncode != 0
    assert up.stderr.strip().splitlines() == [f"lorafleet: Redis at {url} does not answer"]


@pytest.mark.parametrize("bad", ["--trainers=0", "--slots=0"])
def test_up_rejects_nonsense_counts(tmp_path: Path, bad: str) -> None:
    up = _run(["up", bad], tmp_path)
    assert up.returncode != 0
