"""The controller refuses to start, with one line naming the problem, when Redis is not there."""

from __future__ import annotations

import os
import subprocess
import sys

from lorafleet.testing import free_port


def test_unreachable_redis_stops_the_controller_at_once() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {
        **os.environ,
        "LORAFLEET_CONTROLLER_REDIS_URL": url,
        "LORAFLEET_CONTROLLER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_controller"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"error: cannot reach Redis at {url}: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
