"""Chaos under `lorafleet up`'s supervision: a trainer SIGKILL, a controller SIGKILL and a
20 s Redis stall (SIGSTOP/SIGCONT), each in the middle of a 30-step fixed-seed SDK run, with
no manual restart. Every run must end with exactly the weights of an uninterrupted run
(no step lost, none applied twice), and reports how long the fault stalled it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
FAULT_AT = 10  # the fault hits once this many steps are done
STALL_SECONDS = 20.0


def _sdk_run(fleet, python: Path, fault=None) -> tuple[bytes, float]:
    """One SDK run; `fault()` is called once FAULT_AT steps are done. Returns the saved
    adapter's bytes and the longest pause between two steps (the fault's recovery time)."""
    env = dict(
        os.environ,
        TINKER_BASE_URL=fleet.base_url,
        TINKER_API_KEY=fleet.api_key,
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        CHAOS_STEPS=str(STEPS),
    )
    proc = subprocess.Popen(
        [str(python), str(REPO / "tests" / "e2e" / "chaos_script.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    times, saved = [], ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, *rest = line.split()
            if word == "STEP":
                times.append(float(rest[1]))
                if fault is not None and len(times) == FAULT_AT:
                    fault()
            elif word == "SAVED":
                saved = rest[0]
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-4000:]  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(times) == STEPS and saved.startswith("tinker://")
    rid, name = saved.removeprefix("tinker://").split("/weights/")
    weights = fleet.config.run_dir / "storage" / rid / name / "adapter_model.safetensors"
    return weights.read_bytes(), max(b - a for a, b in itertools.pairwise(times))


@pytest.mark.timeout(3600)
def test_every_fault_recovers_to_the_uninterrupted_weights(make_fleet, sdk_python) -> None:
    python = sdk_python("0.38.0")
    trainer_env = {"LORAFLEET_TRAINER_SNAPSHOT_EVERY_STEPS": "4"}
    with make_fleet(slots=4, backoff_initial=0.2, extra_env={"trainer": trainer_env}) as fleet:
        expected, normal = _sdk_run(fleet, python)

        def kill(name: str):
            return lambda: os.kill(fleet.member(name).proc.pid, signal.SIGKILL)

        def stall_redis() -> None:
            pid = fleet.member("redis").proc.pid
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STALL_SECONDS)  # the fault itself: Redis frozen this long
            os.kill(pid, signal.SIGCONT)

        faults = {
            "trainer SIGKILL": kill("trainer-0"),
            "controller SIGKILL": kill("controller"),
            "redis 20 s stall": stall_redis,
        }
        repeats = int(os.environ.get("CHAOS_REPEATS", "1"))
        recovery: dict[str, list[float]] = {}
        for name, fault in faults.items():
            for _ in range(repeats):
                weights, pause = _sdk_run(fleet, python, fault)
                assert weights == expected, f"{name}: the weights differ from the reference"
                recovery.setdefault(name, []).append(round(pause - normal, 1))
        print(
            json.dumps({"normal_step_pause_s": round(normal, 2), "recovery_s_by_fault": recovery})
        )
