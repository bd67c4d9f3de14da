"""The examples, run through the real tinker SDK against a real fleet on the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[2]


def _sdk_python(version: str) -> Path:
    python = REPO / ".venvs" / f"tinker-{version}" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no tinker {version} venv: run tests/sdk/setup_venvs.sh")
    return python


def _run_example(fleet, name: str, tmp_path: Path, **env: str) -> str:
    python = _sdk_python("0.38.0")
    full_env = dict(os.environ, TINKER_BASE_URL=fleet.base_url, TINKER_API_KEY=fleet.api_key,
                    TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", **env)  # fmt: skip
    out = subprocess.run(
        [str(python), str(REPO / "examples" / name)],
        env=full_env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr[-4000:]}"
    return out.stdout


def test_quickstart_learns_the_fact(shared_fleet, tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    stdout = _run_example(shared_fleet, "quickstart.py", tmp_path,
                          QUICKSTART_STEPS="40", QUICKSTART_LR="3e-3",
                          QUICKSTART_PLOT=str(plot))  # fmt: skip
    assert "OK: the model learned the fact" in stdout
    after = re.search(r"after training:.*A: '(.*)'", stdout)
    assert after and "Dima" in after.group(1)
    first, last = map(float, re.search(r"loss: first ([\d.]+), last ([\d.]+)", stdout).groups())
    assert last < first / 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_tenant_adapters_learn_their_own_facts(shared_fleet, tmp_path: Path) -> None:
    stdout = _run_example(shared_fleet, "multi_tenant.py", tmp_path,
                          EXAMPLE_STEPS="40", EXAMPLE_LR="3e-3")  # fmt: skip
    assert stdout.count("  OK") == 3 and "WRONG" not in stdout


def test_rl_arithmetic_runs_importance_sampling(shared_fleet, tmp_path: Path) -> None:
    stdout = _run_example(shared_fleet, "rl_arithmetic.py", tmp_path, EXAMPLE_ITERS="3")
    iterations = re.findall(r"iteration +\d+: mean reward ([\d.]+)", stdout)
    assert len(iterations) == 3
    assert all(0.0 <= float(r) <= 1.0 for r in iterations)
