"""Issue 35's promise through the real SDK (tinker 0.38.0) on the fleet `lorafleet up --model
tiny` starts: 48 tenants' adapters on a rollout that keeps 16 loaded all publish and sample;
sampled again in shuffled order each returns the same greedy tokens; reopened by path from
new clients after the publishing sessions ended, and across a rollout killed while those
samples run, each returns them again and none fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import child_env, wait_until

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("many_adapters_sdk_script.py")
TENANTS = 48


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_48_tenants_publish_sample_and_reopen_across_a_rollout_restart(
    make_fleet, sdk_python
) -> None:
    python = sdk_python("0.38.0")
    with make_fleet(slots=8) as fleet:  # `lorafleet up`'s defaults: 8 trainer slots
        model = httpx.get(
            f"{fleet.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": fleet.api_key},
            timeout=60,
        ).json()["supported_models"][0]["model_name"]
        keys = [fleet.create_api_key(f"team-{i}", "many adapters") for i in range(TENANTS)]
        env = child_env(
            TINKER_BASE_URL=fleet.base_url, SMOKE_BASE_MODEL=model, MANY_KEYS=json.dumps(keys)
        )
        env.pop("TINKER_API_KEY", None)  # each client names its own tenant's key
        proc = subprocess.run(
            [str(python), str(SCRIPT)],
            env={**env, "MANY_PHASE": "publish"},
            capture_output=True,
            text=True,
            timeout=1500,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        published = _result(proc.stdout)
        assert published["errors"] == []
        tenants = published["tenants"]
        assert len(tenants) == TENANTS
        for i, t in tenants.items():
            assert t["again"] == t["first"], i  # evicted and reloaded: the same tokens
        # The adapters differ (each tenant samples its own weights, not a neighbour's).
        assert len({tuple(t["first"]) for t in tenants.values()}) > TENANTS // 2

        rollout = fleet.member("rollout-0")
        reopen = subprocess.Popen(
            [str(python), str(SCRIPT)],
            env={
                **env,
                "MANY_PHASE": "reopen",
                "MANY_PATHS": json.dumps({i: t["path"] for i, t in tenants.items()}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert reopen.stdout is not None
            first = reopen.stdout.readline()
            assert first.startswith("SAMPLED "), first + reopen.stderr.read()[-6000:]
            pid = rollout.proc.pid
            os.kill(pid, signal.SIGKILL)  # the rest of the samples meet a restarting rollout
            wait_until(lambda: rollout.proc.pid != pid, "rollout-0 restarted")
            stdout, stderr = reopen.communicate(timeout=1500)
        finally:
            reopen.kill()
        assert reopen.returncode == 0, stdout[-3000:] + stderr[-6000:]
        reopened = _result(first + stdout)
    assert reopened["errors"] == []
    assert reopened["tenants"] == {i: t["first"] for i, t in tenants.items()}
