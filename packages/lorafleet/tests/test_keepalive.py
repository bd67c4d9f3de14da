"""Channels and servers agree on keepalive: no GOAWAY "too_many_pings" on idle connections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lorafleet.testing import child_env

PROBE = Path(__file__).parent / "keepalive_probe.py"


def _probe(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(PROBE), *args],
        env=child_env(GRPC_VERBOSITY="INFO"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_idle_channels_keep_their_connection() -> None:
    assert "too_many_pings" in _probe("--strict-server")  # the probe sees a disagreement
    assert "too_many_pings" not in _probe()
