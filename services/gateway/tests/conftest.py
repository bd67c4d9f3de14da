"""Gateway test fixtures: the real-SDK venvs (built by tests/sdk/setup_venvs.sh)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def sdk_python() -> Callable[[str], Path]:
    """sdk_python("0.38.0") → that venv's python, or skip with the command that builds it."""

    def find(version: str) -> Path:
        python = REPO / ".venvs" / f"tinker-{version}" / "bin" / "python"
        if not python.exists():
            pytest.skip(f"no tinker {version} venv: run tests/sdk/setup_venvs.sh")
        return python

    return find


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[object]:
    """Redis, controller, one trainer, one rollout and this gateway, as real processes."""
    from lorafleet_cli.fleet import Fleet, FleetConfig

    config = FleetConfig(
        model_path=tiny_model_dir,
        run_dir=tmp_path_factory.mktemp("fleet"),
        trainers=1,
        rollouts=1,
        slots=4,
        extra_env={
            "gateway": {
                "LORAFLEET_GATEWAY_LONG_POLL_SECONDS": "2",
                "LORAFLEET_GATEWAY_MAX_BODY_BYTES": str(1 << 20),
            }
        },
    )
    with Fleet(config) as running:
        yield running
