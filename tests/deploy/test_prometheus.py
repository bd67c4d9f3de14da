"""Every dashboard query returns data from a real Prometheus scraping the real fleet.

The fleet (controller, trainer, rollout, gateway as processes on loopback) runs a short
training-and-sampling job through the tinker SDK while Prometheus scrapes every service each
second; then each panel's PromQL runs against Prometheus's HTTP API, with Grafana's
`$__rate_interval` replaced by a fixed window. This is the only place a dashboard meets the
services' real metric names and labels (platform.md §8). Prometheus is installed by CI
(`apt-get install -y prometheus`); without it the test skips.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from lorafleet import hub
from lorafleet.testing import WAIT_SECONDS, child_env, free_port, stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "deploy" / "helm" / "lorafleet" / "dashboards").glob("*.json"))
METRICS_TXT = REPO / "deploy" / "dashboards" / "metrics.txt"
SDK_PYTHON = REPO / ".venvs" / "tinker-0.38.0" / "bin" / "python"
WINDOW = "1m"


def _exprs() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every query of every panel."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                out.append((dashboard["uid"], panel["title"], target["expr"]))
    return out


def _listed_metrics() -> list[str]:
    lines = METRICS_TXT.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    return path


def _start_prometheus(binary: str, targets: list[str], data_dir: Path) -> tuple:
    data_dir.mkdir(parents=True)
    config = data_dir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: lorafleet\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log = open(data_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, log, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            log.close()
            raise RuntimeError(
                f"prometheus did not start: {(data_dir / 'prometheus.log').read_text()}"
            )
        time.sleep(0.1)


def _query(url: str, expr: str) -> list:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_query_returns_data(tmp_path, tiny_model_dir, prometheus_binary):
    if not SDK_PYTHON.exists():
        pytest.skip(f"no tinker SDK venv at {SDK_PYTHON}: run tests/sdk/setup_venvs.sh")
    from lorafleet_cli.fleet import Fleet, FleetConfig

    config = FleetConfig(
        model_path=tiny_model_dir, run_dir=tmp_path / "fleet", trainers=1, rollouts=1, slots=2
    )
    with Fleet(config) as fleet:
        targets = sorted(fleet.metrics_targets)  # the gateway's metrics port among them
        prom, log, url = _start_prometheus(prometheus_binary, targets, tmp_path / "prometheus")
        try:
            env = child_env(
                TINKER_BASE_URL=fleet.base_url,
                TINKER_API_KEY=fleet.api_key,
                TINKER_TELEMETRY="0",
                LORAFLEET_BASE_MODEL=hub.served_name(tiny_model_dir),  # the name trainers serve
            )
            run = subprocess.run(
                [str(SDK_PYTHON), str(Path(__file__).with_name("prom_workload.py"))],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            time.sleep(4)  # a few more scrapes, so every rate() has two samples after the run

            # Every metric the dashboards rely on is exported by some service (a labelled
            # counter that never fired has metadata but no series yet).
            missing = []
            for name in _listed_metrics():
                if _query(url, f'count({{__name__="{name}"}})'):
                    continue
                base = re.sub(r"_(bucket|total)$", "", name)
                meta = httpx.get(f"{url}/api/v1/metadata", timeout=10).json()["data"]
                if not ({name, base} & set(meta)):
                    missing.append(name)

            empty = []
            for uid, title, expr in _exprs():
                promql = expr.replace("$__rate_interval", WINDOW)
                if not _query(url, promql):
                    empty.append(f"{uid} / {title}: {promql}")
            # One verdict at the end, so a failing run reports everything the scrape saw.
            problems = [f"not exported by any service: {name}" for name in missing] + [
                f"no data: {line}" for line in empty
            ]
            if "WORKLOAD OK" not in run.stdout:
                problems.append(f"workload failed: {run.stderr[-1500:]}")
            assert problems == [], "\n".join(problems)
        finally:
            stop_process(prom)
            log.close()
