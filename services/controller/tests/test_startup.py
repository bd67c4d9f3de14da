"""The controller refuses to start, with one line naming the problem, when Redis is not there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lorafleet.testing import free_port, redis_server


def _start_controller(redis_url: str) -> subprocess.CompletedProcess[str]:
    """Run a controller on `redis_url` until it exits (it should, at once)."""
    env = {
        **os.environ,
        "LORAFLEET_CONTROLLER_REDIS_URL": redis_url,
        "LORAFLEET_CONTROLLER_PORT": str(free_port()),
    }
    return subprocess.run(
        [sys.executable, "-m", "lorafleet_controller"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unreachable_redis_stops_the_controller_at_once() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = _start_controller(url)
    assert proc.returncode == 2, proc.stderr
    assert f"error: cannot reach Redis at {url}: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_refused_password_is_not_printed(tmp_path: Path) -> None:
    """A Redis that refuses the URL's password stops the controller with one line that
    names the server but not the password (the chart's password is a generated Secret)."""
    with redis_server(tmp_path / "redis", password="the-right-one") as redis:
        proc = _start_controller(f"redis://:wrong-Pa55word@127.0.0.1:{redis.port}/0")
    assert proc.returncode == 2, proc.stderr
    where = f"redis://:***@127.0.0.1:{redis.port}/0"
    assert f"error: cannot reach Redis at {where}: " in proc.stderr, proc.stderr
    assert "wrong-Pa55word" not in proc.stderr
