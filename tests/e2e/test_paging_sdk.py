"""Paging through the real SDK (tinker 0.38.0): three clients on a fleet with one trainer slot
all finish, each with exactly the results of its run alone; the SDK sees only latency."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import child_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
CLIENTS, STEPS = 3, 3


def test_sdk_clients_beyond_the_slots_all_finish_each_as_it_would_alone(
    make_fleet, sdk_python
) -> None:
    python = sdk_python("0.38.0")
    env = {"controller": {"LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS": "0.5"}}
    with make_fleet(slots=1, extra_env=env) as fleet:
        caps = httpx.get(
            f"{fleet.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": fleet.api_key},
            timeout=60,
        ).json()
        proc = subprocess.run(
            [str(python), str(HERE / "paging_sdk_script.py")],
            env=child_env(
                TINKER_BASE_URL=fleet.base_url,
                TINKER_API_KEY=fleet.api_key,
                SMOKE_BASE_MODEL=caps["supported_models"][0]["model_name"],
                PAGING_SEEDS=",".join(str(s) for s in range(1, CLIENTS + 1)),
                PAGING_STEPS=str(STEPS),
                PAGING_PAUSE="1.5",
                PAGING_MODE="both",
            ),
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
        result = json.loads(lines[-1][len("RESULT ") :])
        log = (fleet.config.run_dir / "logs" / "controller.log").read_text()
    assert result["errors"] == []
    # One slot: no run shared a pass with another, so paging is the only difference, and
    # every logprob and loss of every step (and of the final weights) is exactly the same.
    assert result["shared"] == result["alone"]
    assert len(result["shared"]) == CLIENTS
    assert log.count("paged out") >= CLIENTS - 1 and "paged in" in log
