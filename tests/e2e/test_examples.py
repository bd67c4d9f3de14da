"""The examples, run through the real tinker SDK against a real fleet on the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_example(shared_fleet, sdk_python, tmp_path: Path):
    """run_example(name, **env) → stdout of examples/<name> run in tmp_path with tinker 0.38.0
    against the shared fleet (asserts it exits 0)."""
    python = sdk_python("0.38.0")

    def run(name: str, **env: str) -> str:
        full_env = dict(
            os.environ,
            TINKER_BASE_URL=shared_fleet.base_url,
            TINKER_API_KEY=shared_fleet.api_key,
            TINKER_TELEMETRY="0",
            HF_HUB_OFFLINE="1",
            **env,
        )
        out = subprocess.run(
            [str(python), str(REPO / "examples" / name)],
            env=full_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr[-4000:]}"
        return out.stdout

    return run


def test_quickstart_learns_the_fact(run_example, tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    stdout = run_example(
        "quickstart.py", QUICKSTART_STEPS="40", QUICKSTART_LR="3e-3", QUICKSTART_PLOT=str(plot)
    )
    assert "OK: the model learned the fact" in stdout
    after = re.search(r"after training:.*A: '(.*)'", stdout)
    assert after and "Dima" in after.group(1)
    first, last = map(float, re.search(r"loss: first ([\d.]+), last ([\d.]+)", stdout).groups())
    assert last < first / 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_tenant_adapters_learn_their_own_facts(run_example) -> None:
    stdout = run_example("multi_tenant.py", EXAMPLE_STEPS="40", EXAMPLE_LR="3e-3")
    assert stdout.count("  OK") == 3 and "WRONG" not in stdout


def test_rl_arithmetic_runs_importance_sampling(run_example) -> None:
    stdout = run_example("rl_arithmetic.py", EXAMPLE_ITERS="3")
    iterations = re.findall(r"iteration +\d+: mean reward ([\d.]+)", stdout)
    assert len(iterations) == 3
    assert all(0.0 <= float(r) <= 1.0 for r in iterations)
